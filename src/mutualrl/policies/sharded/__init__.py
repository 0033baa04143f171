"""A policy's learner sharded across several processes (ranks) with FSDP2.

* ``fsdp``: the ``Sharded`` placement: the model built once per rank without its weights, wrapped
  with ``fully_shard`` per decoder layer and at the root over a one-dimensional ``DeviceMesh``,
  its weights taken from rank 0's full copy; gradients reduced by summing;
* ``share``: ``GroupShare``, which micro-batches of a step are this rank's, and what ranks agree
  on (finiteness, statistics);
* ``mirror``: rank 0's full copy of the weights for generation, refreshed per parameter after
  every change and checked against the sharded model by a probe;
* ``worker``: ``ShardedPolicy``, one rank's side of a policy worker.

Its state on disk is ``policies.dcp``'s (a one-rank policy reads it too). The processes and
their process group are the executor's (``workers.ranks``).
"""
