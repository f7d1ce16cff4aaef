"""The pure core: the phase state machine (phases.py), the records it moves (records.py) and a
phase's time rules (leases.py), the planner (planner.py) with what it gathers and writes
(draft.py), the events a transition tells (transition_events.py) and the topologies it asks
(dag.py, graph_plan.py), the run's rules (rules.py), queueing and beginning (begin.py), and the
records as data (fields.py, snapshot.py, batch.py, events.py, outcomes.py). No I/O."""
