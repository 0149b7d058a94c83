"""Issue 28 (tenants), the judge: the join and the samples never cross tenants (no broker).

Two tenants reuse one session id, interleaved in one partition (a shared key hash): each
tenant's turn is joined with its own tenant's next state, one tenant's end does not end the
other's session, and the samples carry their turn's tenant and adapter in their own id space.
"""

from __future__ import annotations

import hashlib

from pipeline import events
from pipeline.bus import Record
from pipeline.judge.join import FLUSH, JUDGE, Joiner, session_of, split_session
from pipeline.judge.reorder import Reorderer
from pipeline.judge.samples import rl_flush_sample, sample_id

TP = ("turns", 0)
_V = hashlib.sha256(b"v").hexdigest()
ADAPTER = {"name": events.adapter_name("alice", _V), "version": _V, "sha256": hashlib.sha256(b"f").hexdigest()}


class Stream:
    def __init__(self):
        self.offset, self.ts = 0, 1_000_000

    def rec(self, ev):
        self.ts += 10
        r = Record(TP[0], TP[1], self.offset, events.session_key(ev.tenant, ev.session_id), ev, self.ts)
        self.offset += 1
        return r


def turn(tenant, k, adapter=None):
    return events.Turn(session_id="shared", turn_index=k, request_id=f"r-{tenant}-{k}", tenant=tenant, adapter=adapter,
                       messages=[{"role": "user", "content": f"q{k}"}], prompt_token_ids=[1],
                       response_token_ids=[2], response_logprobs=[-0.5], finish_reason="stop")


def ns(tenant, k, text):
    return events.NextState(session_id="shared", messages=[{"role": "user", "content": text}], after_turn_index=k,
                            tenant=tenant)


def test_keys():
    assert session_of(turn(None, 0)) == "shared" and split_session("shared") == (None, "shared")
    assert session_of(turn("a", 0)) == ("a", "shared") != session_of(turn("b", 0))
    assert split_session(("a", "shared")) == ("a", "shared")


def test_two_tenants_one_session_id_are_two_joins():
    j, s = Joiner(300, at_least_one=True), Stream()
    for rec in (s.rec(turn("alice", 0, ADAPTER)), s.rec(turn("bob", 0)), s.rec(turn(None, 0))):
        assert j.on_record(rec) == (False, [])
    assert j.waiting == 3
    _, jobs = j.on_record(s.rec(ns("bob", 0, "bob's reply")))
    (job,) = jobs
    assert job.kind == JUDGE and job.turn.tenant == "bob" and job.next_state[0]["content"] == "bob's reply"
    assert job.tenant == "bob" and job.session_id == "shared" and job.key == "bob/shared"
    _, jobs = j.on_record(s.rec(events.SessionEnd(session_id="shared", tenant="bob")))  # bob's end only
    assert [x.kind for x in jobs] in ([], ["release"])
    assert j.waiting == 2
    _, jobs = j.on_record(s.rec(ns("alice", 0, "alice's reply")))
    (job,) = jobs
    assert job.turn.tenant == "alice" and job.next_state[0]["content"] == "alice's reply"
    _, jobs = j.on_record(s.rec(events.SessionEnd(session_id="shared")))  # the untenanted session's end
    assert [x.kind for x in jobs if x.kind == FLUSH] == [FLUSH] and jobs[0].turn.tenant is None
    assert jobs[0].key == "shared"  # the key records had before tenants


def test_a_request_id_seen_in_one_tenant_is_no_duplicate_in_another():
    j, s = Joiner(300, at_least_one=False), Stream()
    a, b = turn("alice", 0), turn("bob", 0)
    b.request_id = a.request_id
    j.on_record(s.rec(a))
    j.on_record(s.rec(b))
    assert j.duplicates == 0 and j.waiting == 2


def test_reorderer_keeps_tenants_apart():
    """Bob's next state for turn 1 arrives before his turn 1: held; Alice's turn 1 does not release it."""
    ro, s = Reorderer(lateness_s=60), Stream()
    out = []
    for ev in (turn("bob", 0), ns("bob", 1, "early"), turn("alice", 1)):
        out += ro.on_record(s.rec(ev))
    assert [(r.event.TYPE, r.event.tenant) for r in out] == [("turn", "bob"), ("turn", "alice")]
    out = ro.on_record(s.rec(turn("bob", 1)))
    assert [(r.event.TYPE, r.event.tenant) for r in out] == [("turn", "bob"), ("next_state", "bob")]


def test_samples_carry_tenant_and_adapter_in_their_own_id_space():
    sa, sb, sn = (rl_flush_sample(t, judge="j") for t in (turn("alice", 0, ADAPTER), turn("bob", 0), turn(None, 0)))
    assert (sa.tenant, sa.adapter, sb.tenant, sb.adapter, sn.tenant) == ("alice", ADAPTER, "bob", None, None)
    assert sa.sample_id == "alice/shared:0:rl:r-alice-0" and sn.sample_id == "shared:0:rl:r-None-0"
    t1, t2 = turn("alice", 0), turn("bob", 0)
    t2.request_id = t1.request_id  # even the same request id: two id spaces
    assert sample_id(t1, "rl") != sample_id(t2, "rl")
    for smp in (sa, sb, sn):
        assert events.decode(events.encode(smp)) == smp


def test_retrain_range_ends_each_tenants_session_with_its_tenant():
    """The sessions a replayed range leaves open are (tenant, session id): both tenants' sessions
    of one id get their own end, keyed and tenanted as their records."""
    from pipeline.history.retrain import OpenSessions

    seen, s = OpenSessions(), Stream()
    for ev in (turn("alice", 0), turn("bob", 0), turn(None, 0),
               events.SessionEnd(session_id="shared", tenant="bob")):
        seen.see(s.rec(ev))
    assert seen.open == {("alice", "shared"): "alice/shared", "shared": "shared"}
