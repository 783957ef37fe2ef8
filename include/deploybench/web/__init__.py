"""The results pages: a FastAPI app mounted on the Airflow api-server by plugins/deploybench_results.py."""
