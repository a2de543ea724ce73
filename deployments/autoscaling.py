"""The project's Serve autoscaling policy: an engine deployment sized by its engines' own state.

Set per deployment in serve_config.yaml (``placement.autoscaling.policy``, Serve's field names)::

    autoscaling:
      min_replicas: 1
      max_replicas: 4
      policy: {policy_kwargs: {inter_token_target_s: 0.05}}   # policy_function defaults to this class

Serve's controller builds one :class:`EngineLoadPolicy` per deployment with ``policy_kwargs``
and calls it every control-loop tick with an ``AutoscalingContext``; the replicas' reports
(``EngineHost.record_autoscaling_stats``) arrive in ``ctx.aggregated_metrics``. Serve then
applies ``min_replicas``/``max_replicas``, the up/downscale delays and factors, and the jump
from zero when a request waits for a deployment at zero (Ray 2.60's ``_apply_autoscaling_config``).
The sizing itself is app/engine_load.py's; this module only reads Serve's context.
"""
from __future__ import annotations

from typing import Any

from prefillshare.app.engine_load import EngineLoadTargets, desired_replicas, load_ratios


class EngineLoadPolicy:
    """Replicas = ceil(replicas x the largest load ratio) over first-token, inter-token, KV-cache
    and (optionally) ongoing-request targets. The decision and the signal that made it are kept in
    the policy state (``last_signal``, ``last_ratio``) for Serve's logs."""

    def __init__(self, **policy_kwargs: Any) -> None:
        self.targets = EngineLoadTargets(**policy_kwargs)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        replicas = ctx.current_num_replicas
        if replicas == 0:  # at zero nothing reports; Serve's own jump from zero answers a waiting request
            return ctx.target_num_replicas, dict(ctx.policy_state)
        stats = {name: {str(r): v for r, v in per_replica.items()}
                 for name, per_replica in (ctx.aggregated_metrics or {}).items()}
        ratios = load_ratios(stats, self.targets, ctx.total_num_requests, replicas)
        want, signal = desired_replicas(replicas, ratios)
        state = dict(ctx.policy_state)
        state.update(last_signal=signal, last_ratio=ratios.get(signal, 0.0) if signal else 0.0)
        return want, state
