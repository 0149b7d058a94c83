"""Canary rollout: the promotion / rollback rule, its fold over the records, sticky assignment.

A floor package (no stage imports here; the proxy, the syncers and a future evaluator may import
it). Everything is pure and replayable: :mod:`.rule` decides from counts, :mod:`.fold` turns the
``control`` + ``turns`` + ``samples`` records into those counts and the decisions, and
:mod:`.assign` says which arm serves a session. Off unless enabled (:class:`.rule.RolloutConfig`,
``enabled`` False): nothing in the pipeline calls it by default. See docs/rollout.md.
"""
