"""Rich renderings of plans (rich is imported lazily)."""


def plan_summary(plan):
    from rich.table import Table

    table = Table(title=repr(plan))
    for col in ("leaf", "shape", "offset", "numel", "granule", "ranks"):
        table.add_column(col)
    for leaf in plan.leaves:
        owners = plan.owners(leaf)
        table.add_row(leaf.path, str(leaf.shape), str(leaf.offset), str(leaf.numel), str(leaf.granule),
                      f"{owners[0]}-{owners[-1]}" if owners else "-")
    return table
