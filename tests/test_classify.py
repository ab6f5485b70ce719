"""SLO classification precedence and API-key ceilings (docs/reference.md: HTTP)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.protocol.slo import SLOClass, requested_slo
from gateway.classify import ClassificationError, as_chat_view, classify
from gateway.config import APIKey, GatewayConfig, LengthRule

pytestmark = pytest.mark.gateway_only


def cfg(**kw: object) -> GatewayConfig:
    c = GatewayConfig(**kw)  # type: ignore[arg-type]
    c.check()
    return c


def test_precedence() -> None:
    c = cfg(api_keys={"k": APIKey(default_class="relaxed")}, rules=[LengthRule(10, "interactive")])
    body = {"prompt": "short", "service_tier": "batch"}
    both = {"x-slo-class": "standard", "x-gateway-inference-objective": "batch"}
    assert classify(c, both, body, "k").name == "standard"
    named = classify(c, {"x-gateway-inference-objective": "batch", "x-slo-ttft-ms": "100"}, body, "k")
    assert (named.name, named.ttft_ms, named.priority) == ("batch", 100, c.classes["batch"].priority)  # its target
    explicit = classify(c, {"x-slo-ttft-ms": "300"}, body, "k")
    assert explicit.ttft_ms == 300 and explicit.name == "standard"  # the tightest class meeting 300 ms
    assert classify(c, {}, body, "k").name == "batch"  # service_tier
    assert classify(c, {}, {"prompt": "short"}, "k").name == "relaxed"  # the key's default
    assert classify(c, {}, {"prompt": "short"}, None).name == "interactive"  # rules
    assert classify(c, {}, {"prompt": "x" * 400}, None).name == "standard"  # the default class
    # a batch of prompts is as long as all of them: short ones add up past the rule
    assert classify(c, {}, {"prompt": ["x" * 36] * 2}, None).name == "standard"
    assert classify(c, {}, {"prompt": [[1] * 6, [2] * 6]}, None).name == "standard"
    assert classify(c, {}, {"prompt": [[1] * 6]}, None).name == "interactive"


def test_llm_d_names_and_their_older_aliases() -> None:
    """llm-d's router's headers, each with its older name beside it: llm-d's wins when both are sent,
    and they keep their place in the precedence."""
    c = cfg()
    assert classify(c, {"x-llm-d-inference-objective": "batch"}, {}, None).name == "batch"
    assert classify(c, {"x-llm-d-inference-objective": "relaxed", "x-gateway-inference-objective": "batch"},
                    {}, None).name == "relaxed"
    assert classify(c, {"x-slo-class": "standard", "x-llm-d-inference-objective": "batch"}, {}, None).name == "standard"
    assert classify(c, {"x-llm-d-inference-objective": "batch", "x-llm-d-slo-ttft-ms": "100"}, {}, None).name == "batch"
    both = classify(c, {"x-llm-d-slo-ttft-ms": "300", "x-slo-ttft-ms": "5000"}, {"service_tier": "batch"}, None)
    assert (both.name, both.ttft_ms) == ("standard", 300)
    with pytest.raises(ClassificationError) as bad:
        classify(c, {"x-llm-d-inference-objective": "gold"}, {}, None)
    assert bad.value.param == "x-llm-d-inference-objective"


def test_tpot_sets_the_tbt_target() -> None:
    c = cfg(api_keys={"cheap": APIKey(ceiling="relaxed")})
    assert classify(c, {}, {}, None).tbt_ms == 100  # the class's
    assert classify(c, {"x-llm-d-slo-tpot-ms": "40", "x-slo-tpot-ms": "90"}, {}, None).tbt_ms == 40
    tight = classify(c, {"x-slo-tpot-ms": "30", "x-slo-class": "batch"}, {}, None)
    assert (tight.name, tight.tbt_ms, tight.ttft_ms) == ("batch", 30, 6000)
    # under a ceiling, never tighter than the ceiling's target
    assert classify(c, {"x-llm-d-slo-tpot-ms": "40"}, {}, "cheap").tbt_ms == 200
    assert classify(c, {"x-llm-d-slo-tpot-ms": "500"}, {}, "cheap").tbt_ms == 500
    for bad in ("fast", "0", "nan", "inf", "-1"):
        with pytest.raises(ClassificationError) as refused:
            classify(c, {"x-llm-d-slo-tpot-ms": bad}, {}, None)
        assert refused.value.param == "x-llm-d-slo-tpot-ms"


def test_a_responses_body_is_measured_by_its_input() -> None:
    c = cfg(rules=[LengthRule(10, "interactive")])
    short = as_chat_view({"instructions": "hi", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "short"}]}]})
    assert classify(c, {}, short, None).name == "interactive"
    assert classify(c, {}, as_chat_view({"input": "x" * 400}), None).name == "standard"
    assert classify(c, {}, as_chat_view({"input": "x", "service_tier": "batch"}), None).name == "batch"


def test_ceiling_caps_never_escalates() -> None:
    c = cfg(api_keys={"cheap": APIKey(ceiling="relaxed")})
    assert classify(c, {"x-slo-class": "interactive"}, {}, "cheap").name == "relaxed"
    assert classify(c, {"x-slo-class": "batch"}, {}, "cheap").name == "batch"


def test_bad_values() -> None:
    c = cfg()
    with pytest.raises(ClassificationError, match="unknown SLO class"):
        classify(c, {"x-slo-class": "gold"}, {}, None)
    for bad in ("fast", "-5", "0"):
        with pytest.raises(ClassificationError):
            classify(c, {"x-slo-ttft-ms": bad}, {}, None)


def test_class_names_in_any_case() -> None:
    """Header names are case-insensitive, and so are the classes they name (x-slo-class, the llm-d
    objective headers, service_tier): the class applied is the configured one, by its configured name."""
    c = cfg(classes={**GatewayConfig().classes, "Premium": SLOClass("Premium", ttft_ms=100, tbt_ms=50, priority=9)})
    for header in ("x-slo-class", "x-llm-d-inference-objective", "x-gateway-inference-objective"):
        for sent in ("Interactive", "INTERACTIVE", "interactive"):
            assert classify(c, {header: sent}, {}, None).name == "interactive", (header, sent)
    assert classify(c, {"x-slo-class": "premium"}, {}, None).name == "Premium"
    assert classify(c, {}, {"service_tier": "Batch"}, None).name == "batch"
    assert classify(c, {}, {"service_tier": "AUTO"}, None).name == "standard"  # OpenAI's own tiers name no class
    assert requested_slo({"x-slo-class": "BATCH"}, None, c.classes, "standard").name == "batch"
    assert requested_slo({}, "Relaxed", c.classes, "standard").name == "relaxed"
    with pytest.raises(ClassificationError, match="unknown SLO class 'Gold'"):
        classify(c, {"x-slo-class": "Gold"}, {}, None)


def test_classes_that_differ_only_in_case_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "gw.toml"
    p.write_text('[classes.Batch]\nttft_ms = 9000\ntbt_ms = 200\npriority = 0\n')
    with pytest.raises(ValueError, match="SLO classes 'Batch' and 'batch' differ only in case"):
        GatewayConfig.load(p)


def test_toml_config(tmp_path: Path) -> None:
    p = tmp_path / "gw.toml"
    p.write_text('default_class = "relaxed"\nworkers = ["http://127.0.0.1:9"]\n'
                 '[classes.premium]\nttft_ms = 100\ntbt_ms = 50\npriority = 9\n'
                 '[classes.relaxed]\nttft_ms = 4000\ntbt_ms = 200\npriority = 1\n'
                 '[api_keys.abc]\nceiling = "relaxed"\n')
    c = GatewayConfig.load(p)
    assert c.classes["premium"].priority == 9 and c.api_keys["abc"].ceiling == "relaxed"
    assert set(c.classes) == {"interactive", "standard", "relaxed", "batch", "premium"}  # defaults kept
    p.write_text('[classes.interactive]\nttft_ms = 200\n')  # one field of a default class
    c = GatewayConfig.load(p)
    assert c.classes["interactive"].ttft_ms == 200 and c.classes["interactive"].tbt_ms == 100
    p.write_text('[classes.vip]\nttft_ms = 100\n')  # a new class needs its fields
    with pytest.raises(ValueError, match="missing required field `tbt_ms`"):
        GatewayConfig.load(p)
    p.write_text('default_class = "nope"\n')
    with pytest.raises(ValueError, match="unknown SLO class"):
        GatewayConfig.load(p)
    p.write_text('request_timeout_s = "long"\n')
    with pytest.raises(ValueError):
        GatewayConfig.load(p)
