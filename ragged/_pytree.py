"""The one place that fixes ragged's optree namespace.

Every flatten / map in ragged goes through :data:`pytree`, so custom nodes registered
under the ``"ragged"`` namespace (DBuffer, optimizer states) are always seen as nodes.
"""

import optree

pytree = optree.pytree.reexport(namespace="ragged", module="ragged.pytree")


def keystr(accessor) -> str:
    """Formats an optree accessor as a key path such as ``['layers'][0]['w']``."""
    text = accessor.codify("")
    return text if text else "<root>"


def flatten_with_keystr(tree):
    """Flattens ``tree`` and returns ``(key path strings, leaves, treedef)``."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree, namespace="ragged")
    return [keystr(a) for a in accessors], leaves, treedef
