"""House rule 1: the engine-free core imports without vllm."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CORE_MODULES = ["contracts", "rules", "skip_policy", "metrics", "cost_model", "diffusion", "survival", "fused", "adaptive",
                "adaptive.estimators", "adaptive.solver", "adaptive.guard", "adaptive.controller"]


def test_core_imports_with_vllm_unimportable():
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["vllm"] = None  # any `import vllm` or `import vllm.x` now raises
        import importlib
        import vllm_prove.core
        for name in {CORE_MODULES!r}:
            importlib.import_module("vllm_prove.core." + name)
        try:
            import vllm  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("vllm was importable: the blocker did not work")
        loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        assert loaded == ["vllm"], loaded  # only our None blocker, no submodule
        assert vllm_prove.core.BlockProposal.make_dummy().batch_size == 2
        print("core-ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "core-ok" in result.stdout
