"""torch.optim.AdamW's param groups as DCP stores them (see [Note: what an FSDP2 checkpoint holds]
in ``_fsdp2.py``): read and checked as AdamW's, compared with a ragged ``adamw``'s
hyperparameters, and written as torch holds them."""

from __future__ import annotations

import math
from typing import Any

import torch

from ragged.checkpoint._format import CheckpointMismatchError

__all__ = ["ADAMW_REQUIRED", "read_groups", "adamw_hyperparams", "lr_at", "check_groups", "torch_group"]

ADAMW_REQUIRED = ("lr", "betas", "eps", "weight_decay")
_ADAMW_FLAGS = {"amsgrad": False, "maximize": False}  # torch.optim.AdamW options ragged's adamw does not have


def read_groups(entries: dict[str, Any], head: str, fqns: list[str]) -> dict[str, dict[str, Any]]:
    """``{fqn: its group}`` from the ``param_groups`` entries (nested by index or flat by fqn);
    each group also says where it is stored (``"key"``: its DCP key prefix)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in entries.items():
        group, _, name = key[len(head):].rpartition(".")
        groups.setdefault(group, {})[name] = value
    by_fqn: dict[str, dict[str, Any]] = {}
    for group, values in groups.items():
        if group.isdigit():  # nested: param_groups.<i>.<name>, the group's fqns in "params"
            members = values.get("params")
            if not isinstance(members, list) or not all(isinstance(f, str) for f in members):
                raise CheckpointMismatchError(f"DCP key {head + group + '.params'!r} is not the group's list of "
                                              "parameter names (a param group of get_optimizer_state_dict).")
            for fqn in members:
                by_fqn[fqn] = {k: v for k, v in values.items() if k != "params"} | {"key": head + group}
        else:  # flat (flatten_optimizer_state_dict=True): param_groups.<fqn>.<name>
            by_fqn[group] = values | {"key": head + group}
    lacking = [f for f in fqns if f not in by_fqn]
    if lacking:
        raise CheckpointMismatchError(f"no param group of {head[:-1]!r} holds {lacking[0]!r} ({len(lacking)} such "
                                      "parameters have optimizer state but no group).")
    for fqn in fqns:
        group = by_fqn[fqn]
        missing = [k for k in ADAMW_REQUIRED if k not in group]
        if missing:
            raise CheckpointMismatchError(f"the param group of {fqn!r} lacks {missing} ({group['key']}.*): not an "
                                          "AdamW state (ragged loads torch.optim.AdamW's).")
        odd = {k: group[k] for k, v in _ADAMW_FLAGS.items() if group.get(k, v) != v}
        if group.get("weight_decay") and group.get("decoupled_weight_decay", True) is not True:
            odd["decoupled_weight_decay"] = group["decoupled_weight_decay"]
        if odd:
            raise CheckpointMismatchError(f"the param group of {fqn!r} ({group['key']}.*) has {odd}: that is not "
                                          "torch.optim.AdamW's update (ragged's adamw has no such option).")
    return by_fqn


def adamw_hyperparams(optimizer, where: str) -> dict:
    """The hyperparameters of ``optimizer``, which must be ``rg.optim.adamw``'s (the checkpoint
    holds torch.optim.AdamW's state)."""
    hp = getattr(optimizer, "hyperparams", None)
    if not hp or hp.get("optimizer") != "AdamW":
        raise CheckpointMismatchError(
            f"{where}: the checkpoint holds torch.optim.AdamW state, so the optimizer must be "
            "rg.optim.adamw(lr, b1, b2, eps, weight_decay) (without mask= or wrappers), got "
            f"{'one without hyperparams' if not hp else hp.get('optimizer')}. Fix: pass rg.optim.adamw(...), "
            "or load the weights only with rg.checkpoint.fsdp2(path, optimizer=False).")
    return hp


def lr_at(hp: dict, step: int) -> float:
    """The learning rate of the update after ``step`` (a schedule's value there)."""
    lr = hp["lr"]
    return float(lr(torch.tensor(step))) if callable(lr) else float(lr)


def _same(a, b) -> bool:
    """Equal hyperparameters (numbers, or tuples of them like ``betas``) within 1e-9 relative."""
    a, b = (tuple(a), tuple(b)) if isinstance(a, (tuple, list)) else ((a,), (b,))
    return len(a) == len(b) and all(math.isclose(float(x), float(y), rel_tol=1e-9) for x, y in zip(a, b))


def check_groups(groups: dict[str, dict[str, Any]], names, hp: dict, step: int, where: str) -> None:
    """Refuses a param group of one of ``names`` whose ``lr`` / ``betas`` / ``eps`` / ``weight_decay``
    differ from ``hp``'s (an ``lr`` schedule at ``step``: the next update's learning rate)."""
    ours = {"lr": lr_at(hp, step), "betas": hp["betas"], "eps": hp["eps"], "weight_decay": hp["weight_decay"]}
    scheduled = f" (its schedule at step {step})" if callable(hp["lr"]) else ""
    for p in names:
        group = groups[p]
        for k in ADAMW_REQUIRED:
            if not _same(ours[k], group[k]):
                raise CheckpointMismatchError(
                    f"{where}: the param group of {p!r} has {k}={group[k]!r} ({group['key']}.{k}), the ragged optimizer "
                    f"{k}={ours[k]!r}{scheduled if k == 'lr' else ''}. Fix: build rg.optim.adamw with the checkpoint's "
                    "hyperparameters.")


def torch_group(hp: dict, step: int) -> dict:
    """The param group ``torch.optim.AdamW`` holds for these hyperparameters (no ``params``)."""
    probe = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr_at(hp, step), betas=tuple(hp["betas"]),
                              eps=hp["eps"], weight_decay=hp["weight_decay"])
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}
