"""Test helpers for code built on ragged: hypothesis strategies and tree assertions.

``ragged.testing.strategies`` needs ``hypothesis`` (a test dependency); it is imported only
when used.
"""

from ragged.testing._asserts import assert_trees_all_close as assert_trees_all_close
from ragged.spec._planning import with_buffers as with_buffers
