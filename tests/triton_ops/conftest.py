"""Run the Triton kernels themselves on the CPU when no GPU is present.

``triton.jit`` reads ``TRITON_INTERPRET`` when a function is *decorated*: Triton's own
standard library (``tl.zeros``, ``tl.sum``, ...) when ``triton`` is first imported, our
kernels when a ``triton_ops`` module is imported; the interpreter reads it again at launch.
So the variable is set here, at conftest import time, and the tests reach the kernels only
through ``vllm_prove.core.fused``, which imports ``triton_ops`` lazily.

In a whole-suite run some earlier test may already have imported Triton without the
interpreter (``import vllm`` does). Then the Triton language modules and any imported
``triton_ops`` module are reloaded, so their functions are decorated again, now for the
interpreter. Nothing changes where a GPU exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Triton's modules holding @triton.jit functions, in reload order (the package re-exports).
_TRITON_JIT_MODULES = ("triton.language.standard", "triton.language.random", "triton.language")


def _is_compiled(value: object) -> bool:
    from triton.runtime.jit import JITFunction  # the interpreter's class is not a subclass

    return isinstance(value, JITFunction)


def _redecorate_for_the_interpreter() -> None:
    """Reload whatever was decorated before ``TRITON_INTERPRET`` was set."""
    if "triton" not in sys.modules:
        return  # the first import of Triton will see the variable
    modules = [name for name in _TRITON_JIT_MODULES if name in sys.modules]
    modules += [name for name in sys.modules if name.startswith("triton_ops.")]
    for name in modules:
        module = sys.modules[name]
        if any(_is_compiled(value) for value in vars(module).values()):
            importlib.reload(module)


if not HAS_CUDA and importlib.util.find_spec("triton") is not None:
    os.environ["TRITON_INTERPRET"] = "1"
    _redecorate_for_the_interpreter()


@pytest.fixture(scope="session", autouse=True)
def _interpreted_kernels():
    # Again at the first test: collection of other directories may have imported Triton.
    if not HAS_CUDA and importlib.util.find_spec("triton") is not None:
        _redecorate_for_the_interpreter()
    yield


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: the GPU if there is one, else the CPU under the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
