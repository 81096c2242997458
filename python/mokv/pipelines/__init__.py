"""mokv inside MAX's own pipelines (`max generate`, `max serve`, `max.nn` architectures).

The second front door to mokv's cache: a `max.nn` attention module on mokv's
ops (`attention`), the one mapping of MAX's cache values onto mokv's
(`cache_values`), the adapter that lets MAX's scheduler drive mokv's manager
(`scheduler_manager`) and the custom-architecture module that registers them
with MAX (`architecture`, for `--custom-architectures mokv.pipelines.architecture`).

Nothing is imported here: `import mokv` must not pull in `max.pipelines`, so
import the submodule you need.
"""
