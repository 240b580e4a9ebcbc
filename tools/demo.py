"""`make demo`: the project's main job.

Until the trainer lands this runs the tensor-parallel check: a model built from gptpar's layers trained
on 2 gloo ranks at tp=2, compared step by step with the same model at tp=1.
"""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    sys.argv = [os.path.join(ROOT, "examples", "tp_mlp_classifier.py")]
    runpy.run_path(sys.argv[0], run_name="__main__")
