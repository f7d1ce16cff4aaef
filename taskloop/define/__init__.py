"""Declarations: tasks, loop tasks, gates (tasks.py), workflows and the registry (workflow.py), graph
workflows (graph.py, graph_spec.py), flow loops (flow.py), options (options.py), what a callback
receives (context.py) and the checks they share (validate.py). No I/O at definition time."""
