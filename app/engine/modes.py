"""The hand-over modes, by the name ``serve_config.yaml``'s ``handover`` gives them: the one place
that names their packages.

Each mode is a package of its own (app/engine/pool/, app/engine/nixl/) whose Handover class builds
itself from the app's config (``from_config``); nothing else imports a mode's package
(tests/test_layers.py). A decoder served inside its prefill module's engine (``lora_decoders``)
needs no hand-over at all: it reads the base's KV from vLLM's prefix cache.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from prefillshare.app.engine.handover import Handover

if TYPE_CHECKING:
    from prefillshare.app.config import AppConfig

# config name -> "module:class" of its Handover (imported only when chosen: a mode's package may
# need what another mode's machine lacks, e.g. NIXL)
MODES: dict[str, str] = {
    "pool": "prefillshare.app.engine.pool.handover:PoolHandover",
    "vllm-nixl": "prefillshare.app.engine.nixl.handover:NixlHandover",
}


def handover_for(cfg: AppConfig) -> Handover:
    """The app's hand-over, from the config's ``handover``."""
    module, name = MODES[cfg.handover].split(":")
    cls: type[Handover] = getattr(importlib.import_module(module), name)
    return cls.from_config(cfg)
