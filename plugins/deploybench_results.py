"""The deploybench results pages inside the Airflow UI.

Mounts ``deploybench.web.app`` on the api-server at /deploybench and adds two entries to the UI:
"Benchmarks" in the navigation (the run list), and a "Benchmark results" tab on every DAG run
(that run's stages, load phases and report; other DAGs' runs show "no deploybench results").

Airflow does not put its auth in front of plugin apps; the app checks the Airflow user itself
(``require_airflow_user``). Every Airflow component imports this file: it builds the app object
and nothing else - no database, no network (the store is opened per request).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from deploybench.web.app import create_app, require_airflow_user

URL_PREFIX = "/deploybench"

app = create_app(auth=require_airflow_user)


class DeploybenchResultsPlugin(AirflowPlugin):
    name = "deploybench_results"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "deploybench results"}]
    external_views = [
        {"name": "Benchmarks", "href": f"{URL_PREFIX}/", "destination": "nav", "url_route": "deploybench"},
        # the UI substitutes {DAG_ID} and {RUN_ID} (URL-encoded) for "dag_run" views
        {
            "name": "Benchmark results",
            "href": f"{URL_PREFIX}/dag-runs/{{DAG_ID}}/{{RUN_ID}}",
            "destination": "dag_run",
            "url_route": "deploybench-run",
        },
    ]
