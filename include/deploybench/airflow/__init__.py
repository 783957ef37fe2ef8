"""The Airflow layer: the tasks of a run (``stages``) and the cluster lease as an operator and a
trigger (``lease``). These modules import Airflow; only DAG files and the triggerer import them,
never the library."""
