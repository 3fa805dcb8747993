"""Whether TensorRT (with its Python plugin API) is importable here, and the message when it is not."""

from __future__ import annotations

import importlib.util
from typing import Callable

WHERE_TENSORRT_COMES_FROM = (
    "TensorRT is not installed in this environment. Its builder and plugin API (`tensorrt`, `tensorrt.plugin`, "
    "libnvinfer) are not on PyPI for CPU machines (the `tensorrt` packages there are stubs that download from NVIDIA "
    "at install time). Run on an NVIDIA GPU host with TensorRT >= 10.8: an NGC container such as "
    "nvcr.io/nvidia/tensorrt:25.xx-py3 or nvcr.io/nvidia/tritonserver:25.xx-py3, or the TensorRT tarball from "
    "developer.nvidia.com/tensorrt with its Python wheel installed."
)


class TensorRTUnavailable(RuntimeError):
    """TensorRT (or its plugin API) cannot be imported; the message says where TensorRT comes from."""


def tensorrt_missing_reason() -> str | None:
    """None when `tensorrt` and `tensorrt.plugin` import, else why not (one line)."""
    if importlib.util.find_spec("tensorrt") is None:
        return "the `tensorrt` Python package is not installed"
    try:
        import tensorrt  # noqa: F401
        import tensorrt.plugin  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here
        return f"`import tensorrt.plugin` failed: {type(exc).__name__}: {exc}"
    return None


def require_tensorrt_plugin() -> None:
    reason = tensorrt_missing_reason()
    if reason is not None:
        raise TensorRTUnavailable(f"{reason}. {WHERE_TENSORRT_COMES_FROM}")


def registration(plugin_id: str, define: Callable[[], None]) -> Callable[[], str]:
    """A plugin's `register()`: runs `define` (the `tensorrt.plugin` decorators) the first time, returns the plugin's
    "namespace::name" every time, so `register_all()` may be called by every build and runtime."""
    done: list[bool] = []

    def register() -> str:
        if not done:
            define()
            done.append(True)
        return plugin_id

    return register
