"""The Airflow layer: the tasks of a run (``stages``), of a matrix (``matrix``) and of the regression DAG
(``regression_tasks``), the cluster lease as an operator and a trigger (``lease``), Airflow Connections as
library objects (``connections``, inside tasks and the pages) and the environment of a project-local
Airflow (``home``, no Airflow import: the CLI's demo and the tests use it). The others import Airflow;
only DAG files, the triggerer and the plugin import them, never the rest of the library."""
