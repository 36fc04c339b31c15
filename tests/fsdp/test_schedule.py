"""The step's schedule as pure values: what ``CollectiveSchedule.observe`` learns, and the program it
implies (gathers, frees and reduce-scatters decided by the schedule alone)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from ragged.fsdp._schedule import CollectiveSchedule, Observation, program


def test_initial_schedule_lists_the_units_twice_and_learning_keeps_the_used_entries():
    s = CollectiveSchedule.initial(3)
    assert s.forward == (0, 1, 2, 0, 1, 2) and s.reduce_at == (0, 1, 2) and s.learning
    # rank 0 used entries 0, 1, 3 (unit 0 again at the end); rank 1 also used unit 2
    learnt = s.observe([Observation(used=frozenset({0, 1, 3}), needs=frozenset({(1, 1), (3, 0)})),
                        Observation(used=frozenset({0, 2, 3}), needs=frozenset({(2, 2)}))])
    assert learnt.forward == (0, 1, 2, 0) and not learnt.learning
    # backward reads what was seen read: nothing in entry 0's segment (an embedding's backward)
    assert learnt.needs == (frozenset(), frozenset({1}), frozenset({2}), frozenset({0}))
    # a unit no rank used keeps its first entry (it is still gathered and reduced at its turn)
    assert s.observe([Observation(used=frozenset({0, 3}))]).forward == (0, 1, 2, 0)


def test_observe_inserts_deviations_maps_needs_and_lowers_reduce_points():
    s = CollectiveSchedule(forward=(0, 1, 2, 0), needs=(frozenset(), frozenset({1}), frozenset({2}), frozenset({0})),
                 reduce_at=(0, 1, 2), learning=False)
    t = s.observe([Observation(inserts=((2, 0),), missing=((3, 1),), late=((2, 1),))])
    assert t.forward == (0, 1, 0, 2, 0)  # unit 0 before old entry 2
    assert t.needs == (frozenset(), frozenset({1}), frozenset({0}), frozenset({2}), frozenset({0, 1}))
    assert t.reduce_at == (0, 1, 1)  # unit 2's gradient came in segment 1
    assert t.observe([Observation(late=((0, -1),))]).reduce_at[0] == -1  # after the last event
    assert s.fingerprint() != t.fingerprint() and s.fingerprint() == CollectiveSchedule(**{
        f: getattr(s, f) for f in ("forward", "needs", "reduce_at", "learning")}).fingerprint()


@st.composite
def schedules(draw):
    units = draw(st.integers(1, 4))
    forward = tuple(draw(st.lists(st.integers(0, units - 1), min_size=units, max_size=8)))
    forward = forward + tuple(u for u in range(units) if u not in forward)
    needs = tuple(frozenset(draw(st.sets(st.integers(0, units - 1), max_size=2))) for _ in forward)  # any sets
    reduce_at = tuple(draw(st.integers(-1, forward.index(u))) for u in range(units))
    return CollectiveSchedule(forward=forward, needs=needs, reduce_at=reduce_at, learning=False)


@settings(max_examples=60, deadline=None)
@given(schedules(), st.booleans(), st.booleans())
def test_program_keeps_what_each_entry_and_segment_reads_alive(schedule, reshard, prefetch):
    p = program(schedule, reshard=reshard, prefetch=prefetch)
    alive, n = set(), len(schedule.forward)
    for c, (frees, gathers) in enumerate(p.forward):
        assert set(frees) <= alive and not set(gathers) & (alive - set(frees))
        alive = (alive - set(frees)) | set(gathers)
        assert schedule.forward[c] in alive
    reduced = []
    for e in range(n, -1, -1):
        reduces, frees, gathers = p.backward[e]
        reduced += reduces
        assert set(frees) <= alive and not set(gathers) & (alive - set(frees))
        alive = (alive - set(frees)) | set(gathers)
        if e > 0:
            assert p.segment_units[e - 1] <= alive  # segment e - 1 runs after event e
        if e == n:
            assert not set(p.start_prefetch) & alive
            alive |= set(p.start_prefetch)  # issued when backward first reaches the model
    assert alive == set()
    assert sorted(reduced + list(p.end)) == list(range(len(schedule.reduce_at)))  # every unit reduced once
