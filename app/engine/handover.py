"""The hand-over seam: how a prefill module's prompt KV reaches the decoders that read it.

One :class:`Handover` per app, chosen once by the plan from the config's ``handover`` (the registry:
:mod:`prefillshare.app.engine.modes`); the engine deployments receive it whole and ask it what differs between modes:

- the ``kv_transfer_config`` of each engine, by role (:meth:`Handover.transfer_config`);
- what a replica adds to its engine's config on its own node (:meth:`Handover.on_node`);
- a prefill call's ``kv_transfer_params`` and the hand-off its ticket carries for each prompt's
  decoder (:meth:`Handover.prefill_params`, :meth:`Handover.handoffs`: an opaque :class:`HandOff`);
- a decode call's ``kv_transfer_params`` and its counters (:meth:`Handover.decode_side`);
- the mode's own metrics: what it keeps per node (:meth:`Handover.node_state`), the counter of its
  decode replicas' events (:attr:`Handover.decode_events`) and its engines' own families
  (:attr:`Handover.engine_metrics`), which the Metrics deployment exports without knowing the mode.

Implementations: :class:`prefillshare.app.engine.pool.handover.PoolHandover` (the node's shared-memory KV pool,
the project's connector) and :class:`prefillshare.app.engine.nixl.handover.NixlHandover` (vLLM's
NixlConnector, a lease per decoder). Nothing here imports vLLM: configs are built where it is
not installed. Hand-over convention (which tokens the base's KV covers): :mod:`prefillshare.app.prompt_split`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from prefillshare.app.config import AppConfig

__all__ = ["Handover", "DecodeSide", "EventCounter", "Family", "HandOff", "NodeState", "Pull", "ModuleLink", "Role",
           "KV_ROLE"]

Role = Literal["producer", "consumer"]
# vLLM's ``kv_role`` of each role, in every mode's ``kv_transfer_config``
KV_ROLE: dict[str, str] = {"producer": "kv_producer", "consumer": "kv_consumer"}


# one metric family as plain data, sent through Ray: (name, help, type, [(sample name, labels, value)])
Family = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]


class HandOff:
    """What a prefill gives the one decoder request that reads a prompt's KV, when its mode needs
    to give anything (vllm-nixl: a lease on the prefill engine's blocks). Opaque outside its mode:
    the request path carries it from the ticket to the decoder's :meth:`DecodeSide.pull`."""

    __slots__ = ()


class NodeState(ABC):
    """What a mode keeps on each node, read as metric families (the pool: its state and the
    counters its engines keep in it). Every engine replica on a node sends its node's."""

    label: str   # the label naming its source on /metrics ("pool")
    source: str  # that label's value (the pool's path)

    @abstractmethod
    def families(self) -> list[Family]:
        """Read now; raises while the state does not exist yet (its creator still starting)."""


@dataclass(frozen=True)
class EventCounter:
    """The counter of a mode's decode replicas' events (:meth:`DecodeSide.finished`'s
    increments), labelled ``module`` (the decoder) and ``event``."""

    name: str
    help: str


@dataclass(frozen=True)
class ModuleLink:
    """What an engine's transfer config needs of the prefill module whose KV it writes or reads."""

    module_id: str         # the base's identity (prefillshare.app.models.identity), never a served name
    scope: str             # label of this engine's counters (module or decoder name)
    adapter_keys: bool = False  # KV is per LoRA adapter (a prefill module serving adapters)


@dataclass(frozen=True)
class Pull:
    """A decode request's hand-over: the engine's ``kv_transfer_params`` (None: a private
    prefill) and why it is private, if it is (a fallback reason, counted once it finished)."""

    params: dict[str, Any] | None
    reason: str | None = None


class DecodeSide:
    """A decode replica's part of the hand-over (one per replica: it holds counters). The default
    takes nothing per request: the engine's connector finds the KV itself."""

    def pull(self, handoff: HandOff | None) -> Pull | None:
        """The request's hand-over, decided right before the engine takes it; None: nothing to
        pass or count."""
        return None

    def cached_tokens(self, pull: Pull, num_prompt_tokens: int, num_cached_tokens: int) -> int:
        """The prompt tokens a request read from the base's KV, from the engine's count of its
        cached tokens (the default: that count)."""
        return num_cached_tokens

    def finished(self, pull: Pull, num_prompt_tokens: int, num_cached_tokens: int) -> dict[str, float]:
        """Count a finished request; the increments of :attr:`Handover.decode_events` (empty: none)."""
        return {}


class Handover(ABC):
    """How the base's prompt KV moves to a decoder (see the module doc). Instances are small,
    frozen and picklable: Serve sends them to every engine replica."""

    # metric families (besides vLLM's ``vllm:*``) the mode registers in an engine's process, which
    # its replica exports on /metrics
    engine_metrics: frozenset[str] = frozenset()
    # the counter of DecodeSide.finished's increments (None: the mode sends none)
    decode_events: EventCounter | None = None

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: AppConfig) -> Handover:
        """The mode's hand-over for the app (app/engine/modes.py calls it)."""

    @abstractmethod
    def transfer_config(self, role: Role, link: ModuleLink, *, on_gpu: bool = False) -> dict[str, Any]:
        """vLLM's ``kv_transfer_config`` of one engine: ``producer`` on a prefill module, ``consumer``
        on a decoder or decode group that reads ``link``'s KV."""

    def on_node(self, engine_config, host: str):
        """``engine_config`` as the replica that starts it on ``host`` runs it (unchanged by default)."""
        return engine_config

    def node_state(self) -> NodeState | None:
        """A reader of what this mode keeps on the node it is called on (None: nothing)."""
        return None

    @abstractmethod
    def prefill_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` of one prompt's prefill (its KV is read by one decoder)."""

    def handoffs(self, results: Sequence[Any], sent: float) -> tuple[HandOff | None, ...]:
        """What a prefill ticket carries per prompt for its decoder (``results``: PrefillResults or
        None, prefilled from ``sent``, ``time.time()``); () when the decoders need nothing."""
        return ()

    def decode_side(self) -> DecodeSide:
        """A new decode replica's part."""
        return DecodeSide()
