"""Reliability and security parts that need no Ray cluster: API keys and tenant salts, ingress
admission, body parsing, config limits, and what the shipped configs expose.
(The same behaviour end to end, on real engines: tests/shared_app/test_serve_app.py and tests/shared_app/test_serve_faults.py.)"""
from __future__ import annotations

import itertools
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from prefillshare.app.auth import AuthError, KeyRing, load_keyring, tenant_salt
from prefillshare.app.config import ConfigError, LimitsConfig, load_config
from prefillshare.deployments.ingress.admission import (
    STEER_AT,
    Admission,
    LatencyLimit,
    Slot,
    admission_for,
    arrived_at,
)
from prefillshare.deployments.routing.locality import locality_keys

ROOT = Path(__file__).resolve().parent.parent
KEY_A, KEY_B = "sk-unit-acme-00112233445566", "sk-unit-globex-778899aabbcc"


def _minimal(**over) -> dict:
    cfg = {"prefill_modules": [{"name": "base", "model": "checkpoints/base"}],
           "decoders": [{"name": "lookup", "model": "checkpoints/decoders/lookup"}]}
    cfg.update(over)
    return cfg


# --- keys and tenants --------------------------------------------------------------------
def test_keyring_maps_bearer_keys_to_tenants_and_rejects_the_rest():
    ring = KeyRing({KEY_A: "acme", KEY_B: "globex"}, "test")
    assert ring.lookup(f"Bearer {KEY_A}").name == "acme"
    assert ring.lookup(f"bearer  {KEY_B} ").name == "globex"
    for header in (None, "", KEY_A, f"Basic {KEY_A}", "Bearer ", f"Bearer {KEY_A}x", f"Bearer {KEY_A[:-1]}"):
        assert ring.lookup(header) is None, header
    assert KEY_A not in repr(ring) and KEY_B not in repr(ring)


def test_tenant_salt_is_per_tenant_stable_and_never_the_key():
    assert tenant_salt("acme") == tenant_salt("acme") != tenant_salt("globex")
    ring = KeyRing({KEY_A: "acme", "sk-second-key-for-acme-0000": "acme"}, "test")
    assert ring.lookup(f"Bearer {KEY_A}").salt == ring.lookup("Bearer sk-second-key-for-acme-0000").salt
    assert KEY_A not in tenant_salt("acme")


def test_tenant_salt_changes_every_routing_key():
    ids = list(range(3, 200))
    plain = locality_keys("module-1", ids, 32)
    a = locality_keys("module-1", ids, 32, tenant_salt("acme"))
    b = locality_keys("module-1", ids, 32, tenant_salt("globex"))
    assert len(a) == len(b) == len(plain) == 6
    assert not set(a) & set(b) and not set(a) & set(plain)


def test_keys_load_from_file_or_env_and_bad_sources_are_named(tmp_path):
    f = tmp_path / "keys.yaml"
    f.write_text(f"{KEY_A}: acme\n")
    assert load_keyring(None, "PS_KEYS", environ={}) is None  # off by default
    assert load_keyring(f, "PS_KEYS", environ={}).tenants == {"acme"}
    ring = load_keyring(f, "PS_KEYS", environ={"PS_KEYS": f'{{"{KEY_B}": "globex"}}'})
    assert ring.tenants == {"acme", "globex"}
    with pytest.raises(AuthError, match="auth.required"):
        load_keyring(None, "PS_KEYS", required=True, environ={})
    with pytest.raises(AuthError, match="auth.keys_file"):
        load_keyring(tmp_path / "missing.yaml", "PS_KEYS", environ={})
    for text, match in (("- a\n- b\n", "mapping"), ("short: acme\n", "at least 16"),
                        (f"{KEY_A}: 'bad tenant!'\n", "tenant"), ("{{{", "YAML/JSON"), ("{}", "no API keys")):
        f.write_text(text)
        with pytest.raises(AuthError, match=match) as e:
            load_keyring(f, "PS_KEYS", environ={})
        assert KEY_A not in str(e.value)
    f.write_text(f"{KEY_A}: acme\n")
    with pytest.raises(AuthError, match="another tenant"):
        load_keyring(f, "PS_KEYS", environ={"PS_KEYS": f"{KEY_A}: globex"})


# --- admission -----------------------------------------------------------------------------
def test_admission_bounds_inflight_and_slots_release_once():
    adm = Admission(2)
    s1, s2 = (Slot(adm) if adm.try_enter() else None), (Slot(adm) if adm.try_enter() else None)
    assert s1 and s2 and not adm.try_enter()
    assert (adm.inflight, adm.admitted, adm.rejected) == (2, 2, 1)
    s1.release()
    s1.release()  # stream end and cleanup may both release
    assert adm.inflight == 1 and adm.try_enter()
    del s2  # a response dropped before its stream ran still frees its slot
    assert adm.inflight == 1
    with pytest.raises(ValueError):
        Admission(0)


def test_every_admitted_request_is_counted_once_by_route_and_outcome():
    adm = Admission(8)
    slots = [Slot(adm, route) for route in ("completions", "completions", "agents", "chat") if adm.try_enter()]
    slots[0].release("completed")
    slots[0].release("failed")  # a second release changes nothing
    slots[1].release("failed")
    slots[2].release("completed")
    del slots[3]  # dropped before its stream ran: the client left
    snap = adm.snapshot()
    assert snap["outcomes"] == {"agents": {"completed": 1, "failed": 0, "cancelled": 0},
                                "chat": {"completed": 0, "failed": 0, "cancelled": 1},
                                "completions": {"completed": 1, "failed": 1, "cancelled": 0}}
    done = sum(sum(c.values()) for c in snap["outcomes"].values())
    assert snap["admitted"] == done + snap["inflight"] == 4
    with pytest.raises(ValueError, match="outcome"):
        adm.try_enter()
        Slot(adm, "chat").release("lost")


# --- body parsing at the ingress -------------------------------------------------------------
@pytest.mark.parametrize("raw, code, param", [
    (b'{"model": "a", "prompt": "\xff"}', "invalid_encoding", None),
    (b"{", "invalid_json", None),
    (b"[]", "invalid_json", None),
    (b'{"model": "a", "prompt": "p", "top_p": "x"}', "invalid_value", "top_p"),
    (b'{"model": "a", "prompt": "p", "stop": 3}', "invalid_value", "stop"),
])
def test_parse_names_encoding_json_and_field_errors(raw, code, param):
    from prefillshare.deployments.errors import ApiError
    from prefillshare.deployments.ingress.schemas import CompletionBody, parse

    with pytest.raises(ApiError) as e:
        parse(raw, CompletionBody)
    assert (e.value.status, e.value.code, e.value.param) == (400, code, param)


def test_openai_bodies_keep_unknown_fields_and_agent_bodies_reject_them():
    from prefillshare.deployments.errors import ApiError
    from prefillshare.deployments.ingress.schemas import AgentRunBody, CompletionBody, parse

    body = parse(b'{"model": "a", "prompt": "p", "user": "u1", "metadata": {}}', CompletionBody)
    assert body.model_extra == {"metadata": {}} and body.user == "u1"  # `user` is OpenAI's (no effect)
    with pytest.raises(ApiError) as e:
        parse(b'{"context": "c", "agents": [], "user": "u1"}', AgentRunBody)
    assert e.value.param == "user"


# --- config limits -------------------------------------------------------------------------
@pytest.mark.parametrize("over, field", [
    ({"limits": {"max_inflight_requests": 300}}, "max_inflight_requests"),
    ({"orchestrator": {"max_queued_requests": 0}}, "orchestrator.max_queued_requests"),
    ({"decoders": [{"name": "d", "model": "m", "placement": {"max_queued_requests": -2}}]},
     "decoders[0].placement.max_queued_requests"),
    ({"limits": {"retry_after_s": 0}}, "limits.retry_after_s"),
    ({"auth": {"keys": {"a": "b"}}}, "auth.keys"),
])
def test_bad_limits_and_auth_config_name_the_field(over, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(_minimal(**over))


def test_missing_keys_file_is_named(tmp_path):
    cfg = load_config(_minimal(auth={"keys_file": str(tmp_path / "nope.yaml")}))
    with pytest.raises(ConfigError, match="auth.keys_file"):
        cfg.check_paths()


# --- exposure ------------------------------------------------------------------------------
def test_serve_config_binds_http_to_loopback_and_auth_is_off_only_by_absence():
    data = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert data["http_options"]["host"] == "127.0.0.1"
    cfg = load_config(ROOT / "serve_config.yaml")
    assert cfg.auth.keys_file is None and cfg.auth.keys_env == "PREFILLSHARE_API_KEYS"


def test_serve_script_keeps_ray_token_auth_on_unless_told_otherwise():
    script = ROOT / "scripts" / "serve.sh"
    text = script.read_text()
    assert 'RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"' in text
    # the default, as the shell evaluates it with no RAY_AUTH_MODE in the environment
    line = next(ln for ln in text.splitlines() if "RAY_AUTH_MODE=" in ln and ln.startswith("export"))
    out = subprocess.run(["env", "-u", "RAY_AUTH_MODE", "bash", "-c", f"{line}; echo $RAY_AUTH_MODE"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "token"
    # tests are the only place that turns it off
    assert 'RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"' in (ROOT / "scripts" / "test.sh").read_text()


def test_openai_options_become_one_sampling_and_unimplemented_ones_are_refused():
    from prefillshare.app.config import LimitsConfig
    from prefillshare.app.sampling import to_sampling_params
    from prefillshare.deployments.errors import ApiError
    from prefillshare.deployments.ingress.request_options import check_unsupported, sampling_from
    from prefillshare.deployments.ingress.schemas import AgentBody, ChatBody, CompletionBody

    limits = LimitsConfig(max_tokens_default=8, max_tokens_cap=64)
    assert sampling_from(AgentBody(model="m", instruction="i"), limits, 2, 1000).max_tokens == 8
    s = sampling_from(CompletionBody(model="m", prompt="p", stop=["\n"], n=2, temperature=0.7, frequency_penalty=0.5,
                                     logit_bias={"5": 1}, seed=3, user="u"), limits, 2, 1000, logprobs=2)
    assert (s.stop, s.n, s.frequency_penalty, s.logit_bias, s.seed, s.logprobs, s.stop_token_ids) == \
        (("\n",), 2, 0.5, ((5, 1.0),), 3, 2, (2,))
    params = to_sampling_params(s)
    assert (params.stop, params.n, params.logit_bias, params.logprobs) == (["\n"], 2, {5: 1.0}, 2)
    for body, field in ((CompletionBody(model="m", prompt="p", best_of=3), "best_of"),
                        (CompletionBody(model="m", prompt="p", suffix="x"), "suffix"),
                        (ChatBody(model="m", messages=[{"role": "user", "content": "hi"}], store=True), "store"),
                        (ChatBody(model="m", messages=[{"role": "user", "content": "hi"}], guided_json={}),
                         "guided_json")):
        with pytest.raises(ApiError) as e:
            check_unsupported(body)
        assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported_parameter")
    for field, value in (("seed", 2 ** 70), ("temperature", 2.5), ("n", 0), ("n", 2), ("top_k", -2), ("min_p", 1.5)):
        with pytest.raises(ApiError) as e:
            sampling_from(CompletionBody(model="m", prompt="p", **{field: value}), limits, 2, 1000)
        assert (e.value.status, e.value.param) == (400, field)


def test_every_error_code_has_one_http_shape_used_for_json_and_streams():
    from prefillshare.deployments.errors import HTTP, INPUT_FIELD, ApiError, ErrorCode, Failure

    assert set(HTTP) == set(ErrorCode)
    for (code, shape), route in zip(HTTP.items(), itertools.cycle(INPUT_FIELD)):
        err = ApiError.from_failure(Failure(code, "why"), route, retry_after_s=7)
        assert (err.status, err.type, err.code) == (shape.status, shape.type, shape.code)
        assert err.param == (INPUT_FIELD[route] if shape.about_input else None)
        assert err.message == f"{code.value}: why" and set(err.body()["error"]) == {"message", "type", "param", "code"}
        assert (err.headers or {}).get("Retry-After") == ("7" if shape.retry_after else None)
    assert HTTP[ErrorCode.OVERLOADED].status == 429 and HTTP[ErrorCode.DECODER_UNAVAILABLE].status == 503


def test_latency_limit_shrinks_on_a_slow_window_and_grows_back_only_while_binding():
    lim = LatencyLimit(ceiling=64, floor=8, target_s=1.0, window=4)
    for wait in (0.1, 0.2, 0.3, 5.0):  # one slow sample of four: the 95th percentile is 5 s
        lim.observe(wait, lim.epoch)
    assert lim.limit == 48 and lim.epoch == 1
    lim.observe(9.0, 0)  # admitted under the old limit: not judged
    for _ in range(40):
        for _ in range(4):
            lim.observe(9.0, lim.epoch)
    assert lim.limit == 8  # never below the floor
    for _ in range(4):
        lim.observe(0.1, lim.epoch)
    assert lim.limit == 8  # fast, but nobody was turned away: no reason to admit more
    lim.turned_away()
    for _ in range(4):
        lim.observe(0.1, lim.epoch)
    assert lim.limit == 9
    for _ in range(300):
        lim.turned_away()
        lim.observe(0.1, lim.epoch)
    assert lim.limit == 64  # one more per window, never above the ceiling
    lim.observe(float("inf"), lim.epoch)  # a request that timed out counts as slow
    for _ in range(3):
        lim.observe(0.1, lim.epoch)
    assert lim.limit == 48


def test_latency_limit_steers_under_the_target_not_at_it():
    """A window whose 95th percentile is within the target but past STEER_AT of it shrinks the limit:
    the windows hover at the setpoint, so a minute's percentile stays within the target."""
    lim = LatencyLimit(ceiling=16, floor=2, target_s=1.0, window=4)
    assert lim.setpoint_s == pytest.approx(STEER_AT) and STEER_AT < 1
    for _ in range(4):
        lim.observe(0.5 * (1 + STEER_AT), lim.epoch)  # between the setpoint and the target
    assert lim.limit == 12
    exact = LatencyLimit(ceiling=16, floor=2, target_s=1.0, window=4, steer_at=1.0)
    for _ in range(4):
        exact.observe(0.5 * (1 + STEER_AT), exact.epoch)
    assert exact.limit == 16  # steered at the target itself: that window met it
    with pytest.raises(ValueError, match="steer_at"):
        LatencyLimit(16, 2, 1.0, steer_at=1.5)


def test_admission_steered_by_latency_turns_away_past_the_current_limit():
    adm = admission_for(LimitsConfig(max_inflight_requests=4, min_inflight_requests=8, admission_target_s=0.5))
    assert adm.steer.floor == 4 and adm.limit == 4  # the floor is at most the ceiling
    assert admission_for(LimitsConfig()).steer is None  # no target: the fixed bound of today
    adm = Admission(16, LatencyLimit(16, 2, 1.0, window=2))
    slots = [Slot(adm, "chat") for _ in range(4) if adm.try_enter()]
    slots[0].release("failed")  # failed fast (its decoder had no replica): says nothing about the load
    slots[1].release("cancelled")  # its client left
    assert adm.limit == 16 and not adm.steer._waits
    slots[2].late()  # timed out: judged as past the target
    slots[2].release("failed")
    slots[2].release("completed")  # released, and judged, once
    slots[3].release("completed")  # in time; but the window's 90th percentile is the late one
    assert adm.limit == 12 and adm.snapshot()["max_limit"] == 16
    assert all(adm.try_enter() for _ in range(12)) and not adm.try_enter()
    with pytest.raises(ValueError, match="ceiling"):
        Admission(8, LatencyLimit(16, 2, 1.0))


def test_a_latency_limit_starts_low_and_grows_toward_the_setpoint_until_its_first_slow_window():
    lim = LatencyLimit(ceiling=64, floor=2, target_s=1.0, window=2, start=4)
    assert lim.limit == 4 and lim.slow_start
    for want in (8, 16):
        lim.turned_away()
        for _ in range(2):
            lim.observe(0.1, lim.epoch)
        assert lim.limit == want  # doubles: a fresh replica reaches its load in a few windows
    for _ in range(2):
        lim.observe(5.0, lim.epoch)
    assert lim.limit == 12 and not lim.slow_start
    lim.turned_away()
    for _ in range(2):
        lim.observe(0.1, lim.epoch)
    assert lim.limit == 13  # past the first slow window: one more at a time
    near = LatencyLimit(ceiling=64, floor=2, target_s=1.0, window=2, start=8)
    near.turned_away()
    for _ in range(2):
        near.observe(0.8 * near.setpoint_s, near.epoch)
    assert near.limit == 10  # answers at 80% of the setpoint: 1.25x as many, not twice (answers' time ~ in flight)
    assert LatencyLimit(8, 2, 1.0, start=100).limit == 8 and LatencyLimit(8, 2, 1.0, start=1).limit == 2  # clamped
    adm = admission_for(LimitsConfig(max_inflight_requests=64, admission_target_s=5, initial_inflight_requests=16))
    assert adm.limit == 16 and adm.snapshot()["max_limit"] == 64
    assert admission_for(LimitsConfig(max_inflight_requests=64, admission_target_s=5)).limit == 64  # default: the bound


def test_a_lost_replica_shrinks_the_limit_once_it_grows_back_no_further_than_before_until_the_replica_returns():
    lim = LatencyLimit(ceiling=64, floor=2, target_s=1.0, window=2, start=20)
    adm = Admission(64, lim)
    adm.hold(True)
    assert lim.limit == 15  # the loss: 0.75x, once
    adm.hold(True)
    assert lim.limit == 15
    for _ in range(3):  # answers in time while requests are turned away: one more per window, not slow start
        lim.turned_away()
        for _ in range(2):
            lim.observe(0.1, lim.epoch)
    assert lim.limit == 18
    for _ in range(4):
        lim.turned_away()
        for _ in range(2):
            lim.observe(0.1, lim.epoch)
    assert lim.limit == 20  # not past the limit before the loss while short
    for _ in range(2):
        lim.observe(5.0, lim.epoch)
    assert lim.limit == 15  # slow answers still shrink it
    adm.hold(False)
    assert lim.limit == 20  # back: the replica's share at once, the limit it had before the loss
    lim.turned_away()
    for _ in range(2):
        lim.observe(0.1, lim.epoch)
    assert lim.limit == 21  # then one more per window again
    fixed = Admission(8)
    fixed.hold(True)
    assert fixed.limit == 8  # a fixed bound is not steered


def test_an_unanswered_request_past_the_setpoint_shrinks_the_limit_before_any_answer():
    """A burst admitted at the ceiling is judged while it runs: the oldest unanswered request of the
    limit's epoch past the setpoint shrinks the limit at the next arrival, once per epoch."""
    adm = Admission(16, LatencyLimit(16, 2, 1.0, window=4))
    t0 = time.monotonic()
    held = []  # a Slot dropped is released (its client left): keep them
    for _ in range(3):
        assert adm.try_enter()
        held.append(Slot(adm, "chat", t0))  # unanswered
    assert adm.limit == 16  # just arrived: nothing is overdue
    slow = [Slot(adm, "chat", t0 - 2.0) for _ in range(1) if adm.try_enter()]  # arrived 2 s ago, target 1 s
    assert adm.limit == 16
    assert adm.try_enter()  # the next arrival finds it overdue
    assert adm.limit == 12 and adm.steer.epoch == 1
    held.append(Slot(adm, "chat", t0 - 2.0))  # admitted in the new epoch, also 2 s old
    assert adm.try_enter() and adm.limit == 9  # overdue in the new epoch: shrinks again
    adm.try_enter()
    assert adm.limit == 9  # the overdue ones belong to older epochs: judged once
    slow[0].release("completed")
    assert id(slow[0]) not in adm._unanswered


def test_arrival_stamps_of_a_front_proxy_are_read_in_seconds_ms_or_us_and_bounded():
    now = time.time()
    for stamp in (f"t={now - 2:.3f}", f"t={int((now - 2) * 1000)}", f"{int((now - 2) * 1e6)}"):
        waited = time.monotonic() - arrived_at(stamp, 60.0)
        assert 1.9 < waited < 2.5, stamp
    assert time.monotonic() - arrived_at(f"t={now - 3600:.3f}", 60.0) == pytest.approx(60.0, abs=0.5)  # at most
    for stamp in (None, "", "t=soon", f"t={now + 30:.3f}", "t=nan", "t=-5"):  # no wait, never an error
        assert time.monotonic() - arrived_at(stamp, 60.0) < 0.1, stamp


def test_admission_judges_a_request_from_its_arrival_not_its_admission():
    """A request that waited before the Router (in Serve's proxy) counts that wait: within the
    target from admission, past it from arrival, so the limit shrinks."""
    adm = Admission(16, LatencyLimit(16, 2, 1.0, window=2))
    early = time.monotonic() - 2.0  # it arrived 2 s ago; the target is 1 s
    for since in (None, None):
        adm.try_enter()
        Slot(adm, "chat", since).release("completed")
    assert adm.limit == 16  # judged from admission: in time
    for since in (early, early):
        adm.try_enter()
        Slot(adm, "chat", since).release("completed")
    assert adm.limit == 12
