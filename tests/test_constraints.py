"""service/core/scheduler/constraints.py: the constrained rows' grammars, on their own and run by
the real scheduler and core loop on the fake runner (which samples under the masks it is given,
steered towards a script). A constrained request's masks for a decode step are asked for only
after the step before is read; plans without constrained rows carry no masks and nothing waits;
the grammar's end finishes the request with STOP, EOS comes only where the grammar may end,
max_tokens cuts with LENGTH; a preempted request resumes where its grammar stopped; drafts are
cut to what the grammar allows and verified under per-position masks."""

from __future__ import annotations

import numpy as np
import pytest

from service.common.grammar import Compiled, allocate_bitmask
from service.core.scheduler.constraints import Constraints, Verdict
from service.core.scheduler.plan import Draft
from service.core.scheduler.scheduler import SpeculationConfig
from service.protocol import FinishReason, ResponseFormat
from tests.helpers.fake_runner import Harness
from tests.helpers.grammar import EOS, VOCAB, dump, embedded_tokenizer, engine_cache, schema_format

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
DOC = dump({"name": "Ann", "age": 31})


@pytest.fixture(scope="module")
def cache():
    return engine_cache()


@pytest.fixture(scope="module")
def person(cache) -> Compiled:
    return cache.compile(schema_format(PERSON))


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def constraints(rows: int = 4) -> Constraints:
    return Constraints(rows, VOCAB, [EOS])


class Script:
    """Steers each constrained request towards its document (then EOS): the script's next
    token when the mask allows it, else the lowest allowed token."""

    def __init__(self) -> None:
        self.docs: dict[str, list[int]] = {}
        self.harness: Harness | None = None
        self.offered: dict[str, list[int]] = {}  # per request, allowed-set sizes seen

    def __call__(self, request_id: str, position: int, own: int, allowed: np.ndarray) -> int:
        assert self.harness is not None
        at = len(self.harness.seqs[request_id].output_token_ids) + position
        doc = self.docs[request_id]
        want = doc[at] if at < len(doc) else EOS
        self.offered.setdefault(request_id, []).append(len(allowed))
        return want if want in allowed else int(allowed[0])


def harness(script: Script, **config) -> Harness:
    h = Harness(constraints=constraints(config.get("max_batch_size", 4)), steer=script, **config)
    script.harness = h
    return h


def run_document(grammar: Compiled, doc: list[int], max_tokens: int = 64) -> tuple[Harness, str]:
    """One constrained request steered towards `doc`, run to its end."""
    script = Script()
    h = harness(script)
    script.docs["doc"] = doc
    h.submit("doc", max_tokens=max_tokens, grammar=grammar)
    h.run()
    return h, "doc"


# -- on its own --------------------------------------------------------------------------------


def test_masks_only_for_constrained_rows_and_equal_to_one_row_fills(person, tok) -> None:
    c = constraints()
    assert c.masks([0, 1, 2]) is None  # nothing constrained: nothing to fill
    m1, m3 = person.matcher(), person.matcher()
    assert m3.accept(tok.encode('{"name": "A'))
    c.join(1, m1)
    c.join(3, m3)
    masks = c.masks([0, 1, 2, 3])
    assert masks is not None and masks.slots == [1, 3]
    for slot, m, row in zip(masks.slots, (m1, m3), masks.array()):
        one = allocate_bitmask(1, VOCAB)
        m.fill_mask(one[0])
        assert np.array_equal(one[0], row), slot
    assert c.stats.steps == 1 and c.stats.rows == 2 and c.stats.seconds > 0
    c.leave(1)
    assert c.masks([1]) is None


def test_accept_verdicts(person, tok) -> None:
    c = constraints()
    c.join(0, person.matcher())
    ids = tok.encode(DOC)
    for t in ids[:-1]:
        assert c.accept(0, t) == (Verdict.CONTINUE, "")
    assert c.accept(0, ids[-1])[0] is Verdict.END  # "}": nothing but EOS may follow
    c.join(1, person.matcher())
    assert c.accept(1, EOS)[0] is Verdict.END
    verdict, why = c.accept(1, tok.encode("]")[0])
    assert verdict is Verdict.REFUSED and "refused" in why


def test_accept_many_gives_each_rows_accept_verdict(person, tok) -> None:
    """One parallel call for a step's rows: the verdicts and matcher states of one accept per
    row (a free row among them is left out)."""
    ids = tok.encode(DOC)
    many, one = constraints(5), constraints(5)
    for c in (many, one):
        for slot in (0, 1, 2, 4):
            c.join(slot, person.matcher())
            assert c.accept(slot, ids[0])[0] is Verdict.CONTINUE
        for t in ids[1:-1]:
            assert c.accept(4, t)[0] is Verdict.CONTINUE  # slot 4: one token from its end
    slots = np.array([0, 1, 2, 3, 4])
    tokens = np.array([ids[1], EOS, tok.encode("]")[0], 7, ids[-1]])
    got = many.accept_many(slots, tokens)
    want = [(i, *one.accept(int(s), int(t))) for i, (s, t) in enumerate(zip(slots, tokens))]
    assert sorted(got) == sorted(w for w in want if w[1] is not Verdict.CONTINUE)
    assert {i for i, *_ in got} == {1, 2, 4}
    for slot in (0, 2, 4):
        assert many.matcher(slot).tokens == one.matcher(slot).tokens, slot
        assert many.matcher(slot).error == one.matcher(slot).error, slot


def test_masks_begun_early_equal_masks_filled_when_asked(person, tok) -> None:
    """`begin` fills on a thread of its own; `masks` joins it. A row that ended in between keeps
    its mask; rows `begin` did not cover are filled when asked."""
    early, late = constraints(), constraints()
    for c in (early, late):
        c.join(0, person.matcher())
        c.join(2, person.matcher())
        assert c.accept(2, tok.encode('{"name": "A')[0])[0] is Verdict.CONTINUE
    early.begin([0, 1, 2])
    want = late.masks([0, 1, 2])
    got = early.masks([0, 1, 2])
    assert got is not None and want is not None and got.slots == want.slots == [0, 2]
    assert np.array_equal(got.array(), want.array())
    early.begin([0, 2])
    early.leave(2)
    kept = early.masks([0, 2])
    assert kept is not None and kept.slots == [0, 2]
    assert np.array_equal(kept.array(), want.array())
    early.begin([0])
    early.join(2, person.matcher())
    both = early.masks([0, 2])  # slot 2 was not begun: filled now
    assert both is not None and both.slots == [0, 2]
    assert np.array_equal(both.array()[0], want.array()[0])
    assert early.stats.steps == 3 and late.stats.steps == 1


def test_drafts_are_cut_to_what_the_grammar_allows_and_masked_per_position(person, tok) -> None:
    c = constraints()
    m = person.matcher()
    c.join(2, m)
    ids = tok.encode(DOC)
    assert m.accept(ids[:2])
    bad = tok.encode("]")
    assert tok.decode(ids[:3]) == '{"name":'  # then ' "', never "]"
    assert c.draft(2, ids[2:3] + bad + ids[3:4]) == ids[2:3]
    assert c.draft(3, bad) == bad  # unconstrained rows keep their drafts
    c.join(0, person.matcher())
    masks = c.plan_masks([0, 1], [Draft(2, ids[2:5]), Draft(3, [7, 8])])
    assert masks is not None
    assert masks.slots == [0, 2, 2, 2, 2]  # the prefill row, then 3 drafts + 1 of row 2
    rows = masks.array()
    step = m.copy()
    for k in range(4):
        one = allocate_bitmask(1, VOCAB)
        step.fill_mask(one[0])
        assert np.array_equal(one[0], rows[1 + k])
        if k < 3:
            assert step.accept(ids[2 + k])
    assert m.tokens == ids[:2]  # masking drafts changed nothing


# -- in the scheduler and the loop -----------------------------------------------------------------


def test_a_constrained_request_gives_its_document_and_stops_at_its_end(person, tok) -> None:
    h, rid = run_document(person, tok.encode(DOC))
    assert h.tokens(rid) == tok.encode(DOC)  # no EOS needed: "}" ends it
    assert h.final(rid).finish_reason is FinishReason.STOP
    assert not h.sched.constraints.active.any()


def test_masks_come_after_the_step_before_is_read_and_free_batches_pay_nothing(person, tok):
    script = Script()
    h = harness(script, max_batch_size=4)
    h.submit("free-alone", max_tokens=12)
    h.run()
    alone = h.tokens("free-alone")
    assert not any(call[0] == "sample" for call in h.engine.calls)
    assert all(plan.masks is None for plan in h.engine.plans)

    script.docs["json"] = tok.encode(DOC)
    h.submit("free", max_tokens=12)
    h.submit("json", max_tokens=64, grammar=person)
    h.run()
    assert h.tokens("free") == alone  # an unconstrained row gets what it would alone
    assert h.tokens("json") == script.docs["json"]
    calls = h.engine.calls
    samples = [i for i, call in enumerate(calls) if call[0] == "sample"]
    assert samples
    for i in samples:
        step = calls[i][1]
        # Every step before this one was read before its masks were filled (they follow the
        # tokens it sampled), and this one is read only after.
        read_later = {c[1] for c in calls[i:] if c[0] == "collect"}
        assert step in read_later and all(s >= step for s in read_later)


def test_eos_only_where_the_grammar_may_end(cache, tok) -> None:
    script = Script()
    h = harness(script)
    choice = cache.compile(ResponseFormat("choice", options=("yes", "yes!")))
    script.docs["c"] = []  # wants EOS at once: only taken where "yes" or "yes!" is complete
    h.submit("c", max_tokens=10, grammar=choice)
    h.run()
    text = tok.decode([t for t in h.tokens("c") if t != EOS])
    assert text in ("yes", "yes!") and h.tokens("c")[-1] in (EOS, *tok.encode("!"))
    assert h.final("c").finish_reason is FinishReason.STOP


def test_max_tokens_cuts_a_document_with_length(person, tok) -> None:
    h, rid = run_document(person, tok.encode(DOC), max_tokens=4)
    assert h.tokens(rid) == tok.encode(DOC)[:4]
    assert h.final(rid).finish_reason is FinishReason.LENGTH


def test_a_prefill_that_ends_samples_under_its_mask_and_decodes_from_the_next_plan(person, tok):
    script = Script()
    h = harness(script)
    script.docs["json"] = tok.encode(DOC)
    h.submit("json", max_tokens=64, grammar=person)
    h.tick()
    first = h.engine.plans[0]
    assert first.masks is not None and first.masks.slots == [0]
    assert first.decode == []  # its first token's mask was known; the next one's is not
    h.run()
    assert h.tokens("json") == script.docs["json"]


def test_a_preempted_request_resumes_where_its_grammar_stopped(person, tok) -> None:
    script = Script()
    h = harness(script, max_batch_size=1, enable_preemption=True)
    script.docs["low"] = tok.encode(DOC)
    h.submit("low", max_tokens=64, grammar=person, priority=0)
    for _ in range(4):
        h.tick()
    h.submit("high", max_tokens=3, priority=5)
    h.run()
    seq = h.seqs["low"]
    assert seq.preemptions == 1
    assert h.tokens("low") == script.docs["low"]
    assert h.final("low").finish_reason is FinishReason.STOP
    assert seq.matcher is not None and seq.matcher.tokens == script.docs["low"]


def test_drafts_are_validated_and_verified_under_masks(person, tok) -> None:
    script = Script()
    spec = SpeculationConfig(num_draft_tokens=4, max_batch=2, min_ngram=1, max_ngram=3)
    h = harness(script, speculation=spec)
    doc = tok.encode(DOC)
    script.docs["spec"] = doc
    # The prompt holds the document (drafts to look up) and a wrong continuation of its start.
    prompt = [*doc, *doc[:3], *tok.encode("]]]")]
    h.submit("spec", prompt, max_tokens=64, grammar=person)
    h.run()
    assert h.tokens("spec") == doc
    verified = [plan for plan in h.engine.plans if plan.verify]
    assert verified
    for plan in verified:
        assert plan.masks is not None
        assert len(plan.masks.slots) == sum(len(d.tokens) + 1 for d in plan.verify)
        for d in plan.verify:
            assert not set(tok.encode("]]]")) & set(d.tokens)  # cut off before verifying
    seq = h.seqs["spec"]
    assert seq.accepted_tokens > 0


def test_cancel_releases_the_row_grammar(person, tok) -> None:
    script = Script()
    h = harness(script)
    script.docs["gone"] = tok.encode(DOC)
    h.submit("gone", max_tokens=64, grammar=person)
    h.tick()
    h.tick()
    assert h.sched.constraints.active.any()
    h.cancel("gone")
    h.run()
    assert h.final("gone").finish_reason is FinishReason.CANCELLED
    assert not h.sched.constraints.active.any()


def test_masks_allow_every_script_token(person, tok) -> None:
    """The fake samples only what a mask allows: a document the grammar refuses cannot come
    out, whatever the steering wants."""
    script = Script()
    h = harness(script)
    script.docs["bad"] = tok.encode('{"name": 5}')
    h.submit("bad", max_tokens=24, grammar=person)
    h.run()
    out, wanted = h.tokens("bad"), script.docs["bad"]
    assert tok.decode(wanted[:4]) == '{"name": '
    assert out[:4] == wanted[:4]  # fine so far ...
    assert out[4] != wanted[4]  # ... but a number is not a string
    assert person.matcher().accept(out[:-1] if out[-1] == EOS else out)


def test_constrained_steps_read_beside_the_dispatch_give_what_the_loop_thread_would(person, tok):
    """With update_beside_dispatch, the step before a constrained one is read (its grammars
    advanced, the next masks begun) on the loop's second thread while the next forward is
    dispatched up to its logits; every row still gets what it gets read on the loop thread."""
    runs = {}
    for beside in (False, True):
        script = Script()
        h = harness(script, max_batch_size=4, beside=beside)
        script.docs["json"] = tok.encode(DOC)
        h.submit("free", max_tokens=12)
        h.submit("json", max_tokens=64, grammar=person)
        h.run()
        runs[beside] = h
    alone, beside = runs[False], runs[True]
    for rid in ("free", "json"):
        assert beside.tokens(rid) == alone.tokens(rid), rid
        assert beside.final(rid).finish_reason is alone.final(rid).finish_reason, rid
    assert beside.tokens("json") == tok.encode(DOC)
    assert any(call[0] == "sample" for call in beside.engine.calls)
    # Steps whose successors sampled under masks were read on the second thread.
    assert alone.engine.beside_threads == []
    assert len(beside.engine.beside_threads) >= 5
    # There the masks of the step being dispatched were taken and made ready for its sample.
    assert alone.engine.staged_threads == []
    staged = [c for c in beside.engine.calls if c[0] == "stage"]
    sampled = [c for c in beside.engine.calls if c[0] == "sample"]
    assert len(staged) >= 5
    assert all(("sample", *c[1:]) in sampled for c in staged)
    assert set(beside.engine.staged_threads) == set(beside.engine.beside_threads)
