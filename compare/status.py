"""The one vocabulary of a comparison: row statuses and what they mean for the verdict.

======================  ======================================================================
status                  meaning
======================  ======================================================================
``equal``               bit-identical
``close``               differs, within what the precisions involved explain (or within the
                        user's ``rtol``/``atol``)
``inherited``           differs beyond that, but only by carrying an error that arose upstream
                        (a failing record it is computed from), or, for weights, before this step;
                        or its shape differs as rows moved between calls after a selection that
                        differs (tokens routed to other experts: :mod:`compare.routing`)
``DIFF``                differs by more than its sources and the precisions explain: an error
                        arises here
``nan_mismatch``        NaN/Inf at different places, not explained by its sources
``shape_mismatch``      the two sides' shapes differ
``hash_mismatch``       the bits differ: a side holds a digest (``mode="hash"``), not values, and
                        the other's digest or checksum is not the same (dtypes or shapes may differ)
``replica_mismatch``    a side is a distributed run put together from its ranks
                        (:mod:`compare.assembly`), and its ranks hold different copies of this
                        replicated tensor (their bytes' checksums, or statistics, differ): that run
                        is inconsistent here. Its metrics are its base rank's copy's against the
                        other side
``missing_in_a``        the record exists in B only (and ``missing_in_b`` in A only)
``op_only_in_a``        an op record (``dumper.ops``) of A only: B's code did not run that op there
                        (an extra cast, a fused kernel against its decomposition); ``op_only_in_b``
                        likewise. Reported, not a failure: the records around it are compared
``dropped``             a side's dumper dropped the tensor (memory limit): nothing to compare
``unsupported``         a side could not store the values (its index ``value`` says why)
======================  ======================================================================

A comparison fails when any row has a failing status. Its first row in execution order whose
values differ beyond what explains them (``DIFF``, ``nan_mismatch``, ``shape_mismatch``,
``hash_mismatch``, ``replica_mismatch``) is the first divergence; missing, dropped or
unsupported records are counted and listed, not taken for one.
"""
EQUAL, CLOSE, INHERITED, DIFF = "equal", "close", "inherited", "DIFF"
NAN_MISMATCH, SHAPE_MISMATCH, HASH_MISMATCH = "nan_mismatch", "shape_mismatch", "hash_mismatch"
REPLICA_MISMATCH = "replica_mismatch"
MISSING_IN_A, MISSING_IN_B = "missing_in_a", "missing_in_b"
OP_ONLY_IN_A, OP_ONLY_IN_B = "op_only_in_a", "op_only_in_b"
DROPPED, UNSUPPORTED = "dropped", "unsupported"
STATUSES = (EQUAL, CLOSE, INHERITED, DIFF, NAN_MISMATCH, SHAPE_MISMATCH, HASH_MISMATCH,
            REPLICA_MISMATCH, MISSING_IN_A, MISSING_IN_B, OP_ONLY_IN_A, OP_ONLY_IN_B, DROPPED,
            UNSUPPORTED)

PASSING = frozenset({EQUAL, CLOSE})
# Records only one run has (the runs ran other code there, or recorded other things).
ONE_SIDED = frozenset({MISSING_IN_A, MISSING_IN_B, OP_ONLY_IN_A, OP_ONLY_IN_B})
# What the metrics give a record whose values (or statistics) were compared on both sides.
COMPARED = frozenset({EQUAL, CLOSE, DIFF, NAN_MISMATCH})
# Reported, not failures: an inherited error is blamed on its origin; an unsupported tensor is
# one the dumper cannot store by design, not a difference between the runs; an op of one side
# only is a difference in the code run, whose consequences the records around it show.
NOT_BLAMED = frozenset({INHERITED, UNSUPPORTED, OP_ONLY_IN_A, OP_ONLY_IN_B})
FAILING = frozenset(STATUSES) - PASSING - NOT_BLAMED
# Records that carry an error: their own (failing) or one from upstream.
CARRYING = FAILING | {INHERITED}
# Failing statuses judged from the values (the others say a record could not be compared):
# the first divergence is the first row with one of these.
VALUE_FAILURES = frozenset({DIFF, NAN_MISMATCH, SHAPE_MISMATCH, HASH_MISMATCH, REPLICA_MISMATCH})

# Where the error of a divergence comes from (the summary's verdict: a module's computation,
# code between modules, or the weights the step started with), and, with an injected run,
# what a module's local error makes of it (localize's: origin, inherited or fine).
ORIGIN, BETWEEN_MODULES, WEIGHTS, FINE = "origin", "between_modules", "weights", "fine"
