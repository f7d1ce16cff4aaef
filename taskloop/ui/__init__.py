"""The run UI (``taskloop ui``): an ASGI app over the client's read API and actions.

- ``app``: routes, and the actions (create_app)
- ``pages``: what each page shows, read through the client
- ``graph``: a run's workflow as a drawing (pure)
- ``present``: times, durations, values as a person reads them (the templates' filters)
- ``live``: server-sent events fed by blocking reads of a run's event stream
- ``security``: basic auth, security headers, cross-site checks and action tokens
- ``serve``: ``taskloop ui`` (uvicorn), and the checks before it binds
- ``templates/``, ``static/``: Jinja2 pages; htmx, its SSE extension, the stylesheet, one small script
"""
