"""Scheduling: which requests run in a step and which pages they hold (a pure scheduler over
the page allocator and the prefix cache), and the load report that routers read."""
