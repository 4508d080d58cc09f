"""dprorun bootstrap: loaded at start-up by every rank whose PYTHONPATH starts with this folder.

It installs the profiling hooks (dprorun.runtime.bootstrap) only in processes launched by dprorun, then runs
the sitecustomize this file shadows, if any, so the user's environment behaves as without dprorun.
"""
import os
import sys


class _DproPackageFinder:
    """Finds the package `dprorun` (only it) in the folder the launcher named: its parent folder, a source tree's
    root or another environment's site-packages, stays off this interpreter's path."""

    def __init__(self, package_dir):
        self.package_dir = package_dir

    def find_spec(self, name, path=None, target=None):
        if name != "dprorun":
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(name, os.path.join(self.package_dir, "__init__.py"),
                                                      submodule_search_locations=[self.package_dir])


def _dpro_package_finder():
    package_dir = os.environ.get("DPRO_PACKAGE_DIR")
    if package_dir and os.path.isfile(os.path.join(package_dir, "__init__.py")):
        sys.meta_path.insert(0, _DproPackageFinder(package_dir))


def _dpro_install():
    if os.environ.get("DPRO_ENABLED") != "1":
        return
    try:
        from dprorun.runtime.bootstrap import install
    except Exception as exc:  # dprorun not importable in this interpreter: run the job unprofiled
        print(f"[dprorun] warning: hooks not installed ({exc})", file=sys.stderr)
        return
    try:
        install()
    except Exception as exc:
        print(f"[dprorun] warning: hooks failed to install, training continues unprofiled ({exc})",
              file=sys.stderr)


def _dpro_tf_config():
    """`dprorun --backend tf`: this worker's TF_CONFIG from the workers' addresses the launcher set and the rank
    torch elastic gave it (a TF_CONFIG the user set wins). Runs with or without the hooks."""
    workers = os.environ.get("DPRO_TF_WORKERS")
    if not workers or "TF_CONFIG" in os.environ or "RANK" not in os.environ:
        return
    import json

    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers.split(",")},
                                          "task": {"type": "worker", "index": int(os.environ["RANK"])}})


def _dpro_chain_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    search = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", search)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_dpro_package_finder()
_dpro_tf_config()
_dpro_install()
_dpro_chain_sitecustomize()
