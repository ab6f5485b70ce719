"""An SLO class as a plain OpenAI server's `priority` body field reads it, for load generators that
talk to such a server directly (`flowprefill loadtest --send-priority`, `flowprefill bench peer`): the
mapping the gateway sends upstream (gateway/config.py), so there is one."""

from __future__ import annotations

from gateway.config import GatewayConfig, Upstream

# vLLM's (and SGLang's with --schedule-low-priority-values-first); SGLang's default
ORDERS = ("lower_first", "higher_first")


def class_priorities(order: str = "lower_first") -> dict[str, int]:
    """{class: priority}: lower_first gives interactive 0 .. batch 3 (vLLM's convention)."""
    if order not in ORDERS:
        raise ValueError(f"priority order {order!r}: expected one of {', '.join(ORDERS)}")
    cfg = GatewayConfig(upstream=Upstream(priority_order=order))  # type: ignore[arg-type]
    return {name: cfg.upstream_priority(slo) for name, slo in cfg.classes.items()}
