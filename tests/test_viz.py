"""Rich views of plans, rendered to text with Console(record=True)."""

import io

import torch
from rich.console import Console

import ragged as rg
from ragged import spec
from ragged._viz import PALETTE


def render(renderable, width=100, color=False):
    console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor" if color else None)
    console.print(renderable)
    return console.export_text(styles=color)


def test_visualize_draws_each_rank_with_occupancy_and_padding():
    plan = rg.make_plan({"a": torch.empty(3, 4), "b": torch.empty(5, 4)}, world_size=3, align=1)
    lines = render(rg.visualize(plan, width=12)).splitlines()
    assert any("rank 2 ████████····  8/12" in line for line in lines)
    assert any("['b'] (5, 4) ranks 1-2" in line for line in lines)
    assert any("padding (4 elements, 12.50%)" in line for line in lines)


def test_one_colour_per_leaf():
    plan = rg.make_plan({"a": torch.empty(3, 4), "b": torch.empty(5, 4)}, world_size=3, align=1)
    text = render(rg.visualize(plan, width=12), color=True)
    r, g, b = (int(PALETTE[1][i : i + 2], 16) for i in (1, 3, 5))
    assert f"38;2;{r};{g};{b}" in text  # leaf 'b' drawn in the second palette colour


def test_large_world_sizes_elide_ranks():
    plan = rg.make_plan({"w": torch.empty(1000, 8, device="meta")}, world_size=1024, align=1)
    text = render(rg.visualize(plan, max_ranks=6, legend=False))
    assert "rank 0" in text and "rank 1023" in text and "rank 500" not in text
    assert "(1018 ranks not drawn)" in text


def test_rank_table_lists_ragged_rows():
    plan = rg.make_plan({"w": torch.empty(7, 4)}, spec.Rows(1), world_size=3, align=1)
    text = render(rg.rank_table(plan))
    starts = [p.start // 4 for r in range(3) for p in plan.local_pieces(r)]
    for r in range(3):
        (piece,) = plan.local_pieces(r)
        assert f"rows [{piece.start // 4}:{piece.stop // 4})" in text
    assert starts == sorted(starts)


def test_plan_summary_is_the_rich_view_of_a_plan():
    plan = rg.make_plan({"w": torch.empty(6, 4), "b": torch.empty(5)}, world_size=2, align=1)
    text = render(plan)
    assert "world_size m=2" in text and f"shard_size S={plan.shard_size}" in text and "['w']" in text
    assert "naive" not in text
    naive = rg.make_plan({"w": torch.empty(5, 3)}, spec.Rows(1), world_size=2, align=1, strategy="naive")
    assert f"{naive.split_blocks} granules split" in render(naive)


def test_details_add_the_rank_table_and_jupyter_display_works():
    plan = rg.make_plan({"w": torch.empty(6, 4)}, world_size=2, align=1)
    view = rg.visualize(plan, details=True)
    assert "per-rank pieces" in render(view)
    assert hasattr(view, "_repr_mimebundle_")  # rich renderables display themselves in Jupyter


def test_plans_display_themselves_in_jupyter():
    plan = rg.make_plan({"w": torch.empty(6, 4)}, world_size=2, align=1)
    bundle = plan._repr_mimebundle_(include=None, exclude=None)
    assert set(bundle) == {"text/plain", "text/html"} and "shard_size S=12" in bundle["text/plain"]


def test_multi_buffer_plan_draws_each_buffer():
    plan = rg.make_plan({"a": torch.empty(8, 3), "b": torch.empty(4, 5)}, world_size=2, align=1, max_buffers=2)
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(rg.visualize(plan, width=22))
    console.print(plan)
    text = console.export_text()
    assert "2 buffers" in text and "S_b = 12 + 10" in text
    rank_lines = [line for line in text.splitlines() if "rank " in line and "/22" in line]
    assert len(rank_lines) == 2 and all("█│█" in line for line in rank_lines)  # one separator between buffers
    assert "buffer" in text


def test_a_terminal_repl_shows_the_picture_not_the_object():
    plan = rg.make_plan({"a": torch.empty(3, 4), "b": torch.empty(5, 4)}, world_size=3, align=1)
    view = rg.visualize(plan, width=12)
    for text in (repr(view), str(view), repr(rg.rank_table(plan))):
        assert "object at" not in text and "rank" in text
    assert "rank 2 ████████····  8/12" in repr(view) and view.title == "m=3 S=12 float32 dp"
