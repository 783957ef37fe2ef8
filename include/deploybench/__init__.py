"""deploybench: repeatable deploy-and-benchmark runs of LLM inference services.

The library holds every stage of a run (preflight, fanout, rollout, load, store,
analyse/report) as plain functions over typed inputs. It never imports Airflow at
module level, so the CLI, the tests and the DAGs import it the same way.
"""

__version__ = "0.1.0"
