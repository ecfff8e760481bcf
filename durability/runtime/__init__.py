"""Executing a run, one step after another: the claim and the executor (``executor``,
``claims``, ``steps``), what a step's checkpoint holds and how it is committed, waited for or
sent ahead (``checkpointing``, ``commits``, ``sendahead``, ``inflight``), the ``ctx`` a step
receives and what its operations record and replay (``context``, ``journal``, ``effects``,
``waits``, ``records``), and the named fault points the crash tests stop a worker at
(``faults``). It uses the store, the run's state machine and the timeline; nothing outside
it calls into it but the workers, the operations and the test helpers."""
