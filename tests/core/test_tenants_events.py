"""Issue 28 (tenants), events: ``tenant`` and ``adapter`` on the records, legacy records, DLQ.

The domains restated here from docs/tenants.md (not from pipeline/events.py): a tenant is an id
like a session id (1-256 characters), an adapter is exactly ``{name, version, sha256}`` with a
name id and two sha256 hex digests; both are optional and None means absent.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import msgpack
import pytest

from pipeline import events
from pipeline.bus.records import RecordIntake
from pipeline.config import Config
from pipeline.events import MalformedEvent, decode, encode
from tests.legacy_records import sample_v1

H = hashlib.sha256(b"adapter tensors").hexdigest()
ADAPTER = {"name": events.adapter_name("alice", H), "version": H, "sha256": hashlib.sha256(b"files").hexdigest()}
BOB_ADAPTER = dict(ADAPTER, name=events.adapter_name("bob", H))


def _turn(**kw):
    base = dict(session_id="s1", turn_index=0, request_id="r1", created_at=1,
                messages=[{"role": "user", "content": "hi"}], prompt_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.5], finish_reason="stop")
    base.update(kw)
    return events.Turn(**base)


def _sample(**kw):
    base = dict(sample_id="s1:0:rl:r1", session_id="s1", turn_index=0, kind="rl", tokens=[1, 2, 3],
                response_length=1, rollout_log_probs=[-0.5], reward=1.0, votes=[1])
    base.update(kw)
    return events.Sample(**base)


def _legacy(ev) -> bytes:
    """``ev`` as a writer from before tenants: the record without the new keys."""
    obj = msgpack.unpackb(encode(ev), raw=False)
    obj.pop("tenant", None)
    obj.pop("adapter", None)
    return msgpack.packb(obj, use_bin_type=True)


def test_new_fields_round_trip():
    t = _turn(tenant="alice", adapter=dict(ADAPTER))
    assert decode(encode(t)) == t
    s = _sample(sample_id="alice/s1:0:rl:r1", tenant="alice", adapter=dict(ADAPTER))
    assert decode(encode(s)) == s
    for ev in (events.NextState(session_id="s1", messages=[], tenant="bob"),
               events.SessionEnd(session_id="s1", tenant="bob"),
               events.Control(action="pause", epoch=1, tenant="bob", adapter=dict(BOB_ADAPTER)),
               events.TrainStep(step=1, tenant="bob", adapter=dict(BOB_ADAPTER))):
        assert decode(encode(ev)) == ev


@pytest.mark.parametrize("ev", [_turn(), _sample(), events.NextState(session_id="s1", messages=[]),
                                events.SessionEnd(session_id="s1"), events.Control(action="resume", epoch=2)],
                         ids=lambda e: e.TYPE)
def test_legacy_records_decode_with_no_tenant_and_the_same_version(ev):
    raw = _legacy(ev)
    assert b"tenant" not in raw and msgpack.unpackb(raw)["v"] == ev.V
    got = decode(raw)
    assert got.tenant is None and getattr(got, "adapter", None) is None
    assert got == ev


def test_v1_sample_decodes_with_no_tenant():
    got = decode(sample_v1())
    assert got.tenant is None and got.adapter is None


BAD_TENANT = ["", "x" * 257, 5, ["a"]]
BAD_ADAPTER = [{}, {"name": "a", "version": H}, dict(ADAPTER, extra="1"), dict(ADAPTER, version="v1"),
               dict(ADAPTER, sha256=H.upper()), dict(ADAPTER, name=""), dict(ADAPTER, name=7), "alice-lora"]


def _with(ev, **fields) -> bytes:
    obj = msgpack.unpackb(encode(ev), raw=False)
    obj.update(fields)
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("value", BAD_TENANT, ids=repr)
@pytest.mark.parametrize("ev", [_turn(), _sample(), events.NextState(session_id="s1", messages=[]),
                                events.SessionEnd(session_id="s1"), events.Control(action="resume", epoch=2)],
                         ids=lambda e: e.TYPE)
def test_malformed_tenant_is_refused_naming_it(ev, value):
    extra = {"sample_id": f"{value}/s1:0:rl:r1"} if ev.TYPE == "sample" and isinstance(value, str) else {}
    with pytest.raises(MalformedEvent, match=rf"{ev.TYPE}\.tenant"):
        decode(_with(ev, tenant=value, **extra))


@pytest.mark.parametrize("value", BAD_ADAPTER, ids=lambda v: repr(v)[:30])
@pytest.mark.parametrize("ev", [_turn(tenant="a"), _sample(sample_id="a/s1:0:rl:r1", tenant="a"),
                                events.Control(action="resume", epoch=2, tenant="a")], ids=lambda e: e.TYPE)
def test_malformed_adapter_is_refused_naming_it(ev, value):
    with pytest.raises(MalformedEvent, match=rf"{ev.TYPE}\.adapter"):
        decode(_with(ev, adapter=value))


def test_a_sample_id_outside_its_tenants_space_is_refused():
    with pytest.raises(MalformedEvent, match="tenant"):
        decode(_with(_sample(), tenant="alice"))  # id 's1:...' is not in alice's space


def test_session_key():
    assert events.session_key(None, "s1") == "s1"  # the key records had before tenants
    assert events.session_key("alice", "s1") == "alice/s1"


class _StandInDlqProducer:
    """A stand-in for the dead-letter producer: keeps what it is asked to send."""

    def __init__(self):
        self.sent = []

    def send(self, topic, ev, key=None):
        self.sent.append((topic, ev, key))
        return SimpleNamespace(get=lambda timeout=None: None)


@pytest.mark.parametrize("fields", [{"tenant": ""}, {"tenant": "t" * 300}, {"adapter": {"name": "x"}},
                                    {"adapter": dict(ADAPTER, version="latest")}], ids=repr)
def test_malformed_tenant_or_adapter_goes_to_the_dlq_at_decode(fields):
    config = Config()
    producer = _StandInDlqProducer()
    intake = RecordIntake(config, "tenants-test", producer=producer)
    topic = config.topics.name("turns")
    intake._dlq_ready.add(intake.dlq_topic(topic))  # no broker: the DLQ topic counts as existing
    good = SimpleNamespace(topic=topic, partition=0, offset=7, key=b"alice/s1", timestamp=1,
                           value=encode(_turn(tenant="alice")))
    bad = SimpleNamespace(topic=topic, partition=0, offset=8, key=b"alice/s1", timestamp=1,
                          value=_with(_turn(tenant="alice"), **fields))
    assert intake.decode(good).event.tenant == "alice"
    assert intake.decode(bad) is None
    (target, dl, key), = producer.sent
    assert target == intake.dlq_topic(topic) and dl.offset == 8 and key == "alice/s1"
    assert f"turn.{next(iter(fields))}" in dl.error


def test_an_adapter_order_on_control_is_never_read_as_one_about_the_full_weights():
    """The full-weight gate (and the syncers', the trainer's full-weight sync) acts only on orders
    without tenant and adapter: a tenant's adapter pause must not hold every request."""
    from pipeline.proxy.control import ControlFollower, ControlState

    full = events.Control(action="pause", epoch=1)
    scoped = [events.Control(action="pause", epoch=1, tenant="bob"),
              events.Control(action="pause", epoch=1, tenant="bob", adapter=dict(BOB_ADAPTER))]
    assert full.full_weights and not any(ev.full_weights for ev in scoped)
    follower = ControlFollower.__new__(ControlFollower)  # apply() reads only .state and .run_id
    follower.state, follower.run_id = ControlState(), "default"
    for ev in scoped:  # bob's own state changes (his requests are held), never the full weights'
        follower.apply(ev)
    assert not follower.state.paused and follower.state.tenants["bob"].paused
    assert follower.apply(full) and follower.state.paused


@pytest.mark.parametrize("kw, why", [
    (dict(action="pause", adapter=dict(ADAPTER)), "needs its tenant"),
    (dict(action="freeze"), "needs a tenant and no adapter"),
    (dict(action="reset", tenant="bob", adapter=dict(ADAPTER)), "needs a tenant and no adapter"),
    (dict(action="weights", tenant="bob", location="/x", sha256="b" * 64), "needs its adapter"),
    (dict(action="weights", tenant="bob", location="/x", sha256="b" * 64, adapter=dict(BOB_ADAPTER)), "needs its adapter"),
    (dict(action="resume", tenant="bob", adapter=dict(ADAPTER)), "not tenant 'bob''s"),
    (dict(action="thaw", tenant="bob"), "must be one of"),
])
def test_control_orders_about_a_tenant_are_checked_at_decode(kw, why):
    """An adapter order names its tenant; a command names a tenant and no adapter; a tenant's
    ``weights`` carries its adapter, whose tensor checksum is the record's ``sha256``."""
    from pipeline.events import MalformedEvent, decode, encode

    ev = events.Control(epoch=1, **kw)
    with pytest.raises(MalformedEvent, match=why):
        decode(encode(ev))


def test_valid_tenant_orders_round_trip():
    for ev in [events.Control(action="freeze", epoch=0, tenant="bob"),
               events.Control(action="resume", epoch=3, tenant="bob"),
               events.Control(action="weights", epoch=3, tenant="bob", location="/x", sha256=ADAPTER["sha256"],
                              adapter=dict(BOB_ADAPTER))]:
        assert events.decode(events.encode(ev)) == ev


def test_adapter_names_are_safe_and_distinct():
    from pipeline.events import adapter_name, tenant_slug

    assert tenant_slug("alice") == "alice"
    odd = ["a:b", "a/b", "a_b", "..", "x" * 65, "x" * 66]
    slugs = {tenant_slug(t) for t in odd}
    assert len(slugs) == len(odd) and all(":" not in s and "/" not in s and s not in (".", "..") for s in slugs)
    v = "0123456789abcdef" * 4
    assert adapter_name("a:b", v).endswith("@0123456789abcdef") and ":" not in adapter_name("a:b", v)


def test_adapter_version_is_the_sha256_of_the_sha256sum_manifest_of_its_two_files(tmp_path):
    """Reference from the definition (docs/tenants.md): sha256 over ``"<hex>  <name>\\n"`` lines of
    adapter_config.json and adapter_model.safetensors, sorted by name; verify_adapter (which
    reads the tensors once) and adapter_version agree with it, and a torn copy is refused."""
    import hashlib

    import pytest

    from pipeline.events import is_adapter_name
    from pipeline.weightsync import adapter_version, verify_adapter

    (tmp_path / "adapter_config.json").write_bytes(b'{"r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"tensors")
    lines = "".join(f"{hashlib.sha256(b).hexdigest()}  {n}\n"
                    for n, b in (("adapter_config.json", b'{"r": 4}'), ("adapter_model.safetensors", b"tensors")))
    want = hashlib.sha256(lines.encode()).hexdigest()
    assert adapter_version(tmp_path) == verify_adapter(tmp_path) == verify_adapter(tmp_path, want) == want
    (tmp_path / "adapter_model.safetensors.sha256").write_text(
        f"{hashlib.sha256(b'other').hexdigest()}  adapter_model.safetensors\n")
    with pytest.raises(ValueError):
        verify_adapter(tmp_path)
    assert is_adapter_name("alice@" + want[:16]) and not is_adapter_name("alice@" + want[:15])
    assert not is_adapter_name("smollm2-135m") and not is_adapter_name("@" + want[:16])


@pytest.mark.parametrize("ev", [
    _turn(tenant="bob", adapter=dict(ADAPTER)),
    _sample(sample_id="bob/s1:0:rl:r1", tenant="bob", adapter=dict(ADAPTER)),
    events.TrainStep(step=1, tenant="bob", adapter=dict(ADAPTER)),
    events.Control(action="resume", epoch=1, tenant="bob", adapter=dict(ADAPTER, name="bob-any-name"))],
    ids=lambda e: e.TYPE)
def test_a_tenants_record_never_names_another_tenants_adapter(ev):
    """Isolation at decode: a record of tenant bob whose adapter is alice's (or any name that is
    not bob's engine name for that version) is refused, so no stage routes, judges or trains bob
    with it; the DLQ gets it."""
    with pytest.raises(MalformedEvent, match=r"\.adapter names adapter"):
        decode(encode(ev))
