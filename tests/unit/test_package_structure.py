"""Package structure: DeepSpeed stays behind gptpar/training/engine/deepspeed_api.py (and the pipeline-stage builder), and
gptpar/ has no import circle. Both read every import statement, function-local ones included, with `ast`."""
import ast
import os
import re
from gptpar.testing import ROOT

PACKAGE = os.path.join(ROOT, "gptpar")
# The one DeepSpeed module, and the builder of DeepSpeed's PipelineModule (its layer specs and topology).
DEEPSPEED_ALLOWED = {"gptpar/training/engine/deepspeed_api.py", "gptpar/model/pipeline.py"}


def package_files():
    for folder, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT).replace(os.sep, "/"), path


def imported_modules(path):
    """Every module an import statement anywhere in the file names (`from a import b` gives a and a.b), and
    string arguments of importlib.import_module / __import__."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            yield str(node.args[0].value)


def module_name(rel):
    name = rel[:-3].replace("/", ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def test_only_the_deepspeed_module_and_the_pipeline_builder_import_deepspeed():
    offenders = {rel: sorted({m for m in imported_modules(path) if m.split(".")[0] == "deepspeed"})
                 for rel, path in package_files() if rel not in DEEPSPEED_ALLOWED}
    assert {rel: mods for rel, mods in offenders.items() if mods} == {}


def test_no_import_circle_in_the_package():
    modules = {module_name(rel): path for rel, path in package_files()}
    graph = {name: sorted({m for m in imported_modules(path) if m in modules and m != name})
             for name, path in modules.items()}
    circles, state = [], {}  # state: 1 = on the current path, 2 = done

    def visit(name, path):
        state[name] = 1
        for dep in graph[name]:
            if state.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    # gptpar/__init__.py re-exporting its submodules, which import gptpar.x (never gptpar itself), is no circle
    assert [c for c in circles if "gptpar" not in c] == []


# Optional packages: only the option that needs one imports it, inside a function, so the trainer and the tools
# run without them.
OPTIONAL = {"bitsandbytes", "matplotlib", "wandb", "torchao", "lm_eval"}


def import_time_modules(path):
    """The modules a file imports when it is itself imported: every import outside a function body."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        pending.extend(ast.iter_child_nodes(node))


def test_optional_packages_are_imported_only_where_used():
    scripts = [os.path.join(ROOT, folder, name) for folder in ("tools", "bench")
               for name in sorted(os.listdir(os.path.join(ROOT, folder))) if name.endswith(".py")]
    files = [path for _, path in package_files()] + scripts + [os.path.join(ROOT, "pretrain_gpt.py")]
    offenders = {os.path.relpath(path, ROOT): sorted(m for m in import_time_modules(path)
                                                     if m.split(".")[0] in OPTIONAL) for path in files}
    assert {rel: mods for rel, mods in offenders.items() if mods} == {}


# The layers, lowest first: tensor_parallel -> model -> config -> checkpoint -> training, and the estimate, which
# reads the layers' rules (the float8 GEMM shapes) but is read by none of them. A package never imports one above
# it (function-local imports included).
LAYERS = {"gptpar/tensor_parallel/": ("gptpar.model", "gptpar.config", "gptpar.checkpoint", "gptpar.training",
                                      "gptpar.estimate"),
          "gptpar/model/": ("gptpar.training", "gptpar.checkpoint"),
          "gptpar/config/": ("gptpar.training", "gptpar.checkpoint"),
          "gptpar/checkpoint/": ("gptpar.training",)}


def test_no_package_imports_a_layer_above_it():
    offenders = {rel: sorted({m for m in imported_modules(path) if m.startswith(above)})
                 for rel, path in package_files() for folder, above in LAYERS.items() if rel.startswith(folder)}
    assert {rel: mods for rel, mods in offenders.items() if mods} == {}
    assert any(rel.startswith("gptpar/checkpoint/") for rel, _ in package_files())  # the rule has files to check


def test_the_estimate_reads_the_float8_shape_rules_from_the_layers():
    """The float8 GEMM shape rules live beside the layers that run them; the estimate imports them from there (the
    arrow estimate -> tensor_parallel), and the module and its package import no torch, so the planners stay light."""
    rules = os.path.join(PACKAGE, "tensor_parallel", "float8_shapes.py")
    assert "gptpar.tensor_parallel.float8_shapes" in set(imported_modules(os.path.join(PACKAGE, "estimate",
                                                                                       "memory.py")))
    for path in (rules, os.path.join(PACKAGE, "tensor_parallel", "__init__.py")):
        assert not {m for m in import_time_modules(path) if m.split(".")[0] == "torch"}, path


# -- the house: names, and tests that stand alone ----------------------------------------------------------------

def test_no_module_named_after_the_standard_library_or_twice():
    """A module's name says what it is: none shadows the standard library (tensor_parallel/random.py keeps
    Megatron's name) and no two share one (the model's and the run's config, `config.py` and `config/`, may)."""
    import sys

    names = {}
    for rel, _ in package_files():
        base = os.path.basename(rel)[:-3]
        if base == "__init__":
            base = os.path.basename(os.path.dirname(rel))
        names.setdefault(base, []).append(rel)
    stdlib = {base: rels for base, rels in names.items() if base in sys.stdlib_module_names}
    assert stdlib == {"random": ["gptpar/tensor_parallel/random.py"]}
    twice = {base: sorted(rels) for base, rels in names.items() if len(rels) > 1}
    assert twice == {"config": ["gptpar/config/__init__.py", "gptpar/model/config.py"]}


def test_files(folder):
    for parent, _, names in os.walk(os.path.join(ROOT, folder)):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(parent, name)


test_files.__test__ = False  # a helper, not a test


def edits_sys_path(path):
    """`sys.path` used in the file's code, or `sys.path.` in a string (code handed to a child process)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return any((isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys")
               or (isinstance(node, ast.Constant) and isinstance(node.value, str) and "sys.path." in node.value)
               for node in ast.walk(tree))


def test_tests_neither_edit_sys_path_nor_import_each_other():
    """Every test imports what it needs from the installed package (gptpar.testing for what they share), so none
    edits sys.path, not even in code it hands a child process, and none imports another test file."""
    files = list(test_files("tests"))
    assert any(os.sep + "unit" + os.sep in f for f in files) and any(os.sep + "integration" + os.sep in f for f in files)
    edits = [os.path.relpath(f, ROOT) for f in files if edits_sys_path(f) and f != os.path.abspath(__file__)]
    assert edits == []
    local = {os.path.basename(f)[:-3] for f in files} | {"tests", "conftest"}
    imports = {os.path.relpath(f, ROOT): sorted(m for m in imported_modules(f) if m.split(".")[0] in local)
               for f in files}
    assert {rel: mods for rel, mods in imports.items() if mods} == {}


def test_unit_tests_start_no_ranks_and_no_processes():
    """tests/unit is what runs in seconds: nothing there starts a rank, a process group or a subprocess."""
    starts = {"run_distributed", "subprocess", "init_parallel", "init_process_group", "launch_ranks", "run_mains",
              "multiprocessing", "torch.multiprocessing", "init_distributed"}
    offenders = {os.path.relpath(f, ROOT): sorted({m for m in imported_modules(f) if m in starts
                                                   or m.split(".")[-1] in starts})
                 for f in test_files(os.path.join("tests", "unit"))}
    assert {rel: found for rel, found in offenders.items() if found} == {}


# -- comments without history ------------------------------------------------------------------------------------

# Built from parts, so this file's own text matches none of them.
ISSUE_NUMBER = re.compile(r"\bissues?" + r" ?#?\d+", re.I)              # "issue N", "issue #N"
SEED_NUMBER = re.compile(r"(?<![a-z])seeds?" + r"[ _]?0\d\d(?!\d)", re.I)  # "seed NNN", in prose or in a name
DEEPSPEED_PIN = ".".join(("0", "19", "8"))
# The DeepSpeed wrapper names the release its internals are checked against; setup.py and the Makefile pin it.
VERSION_ALLOWED = {"gptpar/training/engine/deepspeed_api.py"}


def code_files():
    """(path relative to the root, text) of the package, the tools, the trainer, the tests (their data too) and the
    benches' scripts: the code whose comments a reader takes for the present."""
    paths = [os.path.join(ROOT, "pretrain_gpt.py")]
    for folder in ("gptpar", "tools", "tests"):
        for parent, _, names in os.walk(os.path.join(ROOT, folder)):
            paths += [os.path.join(parent, n) for n in sorted(names) if n.endswith((".py", ".json", ".sh"))]
    bench = os.path.join(ROOT, "bench")
    paths += [os.path.join(bench, n) for n in sorted(os.listdir(bench)) if n.endswith((".py", ".sh"))]
    for path in paths:
        with open(path, encoding="utf-8") as f:
            yield os.path.relpath(path, ROOT).replace(os.sep, "/"), f.read()


def test_code_carries_no_issue_or_seed_numbers():
    """Comments say what the code does and why, now: 'issue N' or 'seed NNN' means nothing to a reader of the code
    (the planning notes have names: docs/planning.md's Sources), and the DeepSpeed version is said where DeepSpeed
    is wrapped, not in every comment about it."""
    hits = []
    for rel, text in code_files():
        for n, line in enumerate(text.splitlines(), 1):
            if (ISSUE_NUMBER.search(line) or SEED_NUMBER.search(line)
                    or (DEEPSPEED_PIN in line and rel.endswith(".py") and rel not in VERSION_ALLOWED)):
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert hits == []


def test_the_deepspeed_pins_agree():
    """setup.py's requirement, the Makefile's and bench/gpu.sh's installs and the wrapper's DEEPSPEED_VERSION name
    one release."""
    with open(os.path.join(PACKAGE, "training", "engine", "deepspeed_api.py")) as f:
        tree = ast.parse(f.read())
    version = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and [getattr(t, "id", None) for t in node.targets] == ["DEEPSPEED_VERSION"]]
    assert len(version) == 1
    for rel in ("setup.py", "Makefile", os.path.join("bench", "gpu.sh")):
        with open(os.path.join(ROOT, rel)) as f:
            pins = set(re.findall(r"deepspeed==([0-9][0-9A-Za-z.]*)", f.read()))
        assert pins == {version[0]}, (rel, pins, version[0])
