"""The code of the command-line tools in tools/ (each script there is a thin wrapper around one module here, so that
tests and other code import a tool's functions without editing sys.path)."""
