"""What a process group leaves in torch's c10d store, and what ragged takes out so that a job restarts.

[Note: restarts and the rendezvous store]
torchrun keeps one c10d store for the whole job (its agent's, shared with the workers since
torch 2.4, pytorch#135712): the workers of a restarted attempt find every key the failed attempt
wrote, under the same names (the default group is group ``"0"`` in every attempt). Two kinds of
stale keys broke a restart:

* **gloo's addresses.** ``init_process_group`` publishes each rank's listening address under
  ``cpu//0/<rank>`` of its group's store and reads its peers' there. A restarted rank that reads a
  peer's key before that peer has published its new one connects to the dead process's port:
  "Gloo connectFullMesh failed ... Connection refused". torch alone races this way; the more the
  ranks' starts differ (importing ragged before ``init_process_group`` takes a second or more on
  a loaded machine), the surer the failure (``tests/distributed/test_restart_gloo.py``). So once a
  collective of ragged's has completed on a group on this rank, every peer has finished connecting
  (each took part in it) and none reads this rank's address again: :func:`release` deletes it, and
  a restarted attempt finds no address but the new ones (``store.wait`` waits for them). A group
  that ragged never used keeps its keys (the default group of a job whose comms run on subgroups
  only: there ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt a store of its own).
* **ragged's own keys** (a poison's reason, see ``_channel.py`` and ``_ledger.py``): a restarted
  ``handshake="deferred"`` comm read the failed attempt's poison and aborted its new group within
  a second. They live under :func:`incarnation`, which differs between attempts and is the same
  on every rank of one: rank 0's address of this attempt, read when this process first builds a
  comm on the group, i.e. before any collective of ragged's there, so before rank 0 can have
  released it.

Both read torch's key layout (``_KEY``, checked on every torch ragged supports); a backend
without such keys (NCCL) releases nothing and names its keys by the group alone.
"""

from __future__ import annotations

import hashlib
import os
import threading

import torch.distributed as dist

__all__ = ["incarnation", "release"]

_KEY = "cpu//0/{rank}"  # a gloo rank's address in its group's store: the device's prefix, gloo's device 0, the rank
_TOKENS: dict[int, tuple[object, str]] = {}
_RELEASED: dict[int, object] = {}
_LOCK = threading.Lock()


def _store(group):
    try:
        return dist.distributed_c10d._get_process_group_store(group)
    except (AttributeError, KeyError, RuntimeError):  # not a group torch registered (e.g. a split one)
        return None


def incarnation(group) -> str:
    """A name of this attempt of ``group``, the same on every rank (see [Note: restarts and the
    rendezvous store]); ``""`` where the group publishes no address."""
    with _LOCK:
        hit = _TOKENS.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        store, token = _store(group), ""
        try:
            if store is not None and store.check([_KEY.format(rank=0)]):
                token = hashlib.blake2b(store.get(_KEY.format(rank=0)), digest_size=6).hexdigest()
        except RuntimeError:  # the store's host is gone
            pass
        _TOKENS[id(group)] = (group, token)
        return token


def release(group) -> None:
    """Deletes this rank's gloo address from ``group``'s store, once; call it only after a
    collective over the whole group has completed on this rank."""
    if _RELEASED.get(id(group)) is group:  # every later call of the channel or ledger: no lock
        return
    with _LOCK:
        if _RELEASED.get(id(group)) is group:
            return
        _RELEASED[id(group)] = group
    store = _store(group)
    lazy = os.environ.get("TORCH_GLOO_LAZY_INIT", "0") not in ("", "0")  # pairs connect at first use: keep it
    if store is not None and not lazy and "gloo" in str(dist.get_backend(group)).lower():
        try:
            store.delete_key(_KEY.format(rank=group.rank()))
        except RuntimeError:  # best effort: the store's host may be gone
            pass
