"""What the tests share, imported by its package name from every test folder (``from tests.support import
lab_names``): the fixtures every test may ask for (``fixtures``, loaded as a pytest plugin by
tests/conftest.py), and helper modules that build what several test folders need:

- ``lab_names``: a lab name nobody else on the machine uses
- ``store_fixtures``: throwaway databases and stored runs (store, compare, history, page tests; bench/)
- ``load_records``, ``run_folders``: the load stage's records and a whole run folder, as the pipeline writes them
- ``airflow_python``: code run in a fresh interpreter with Airflow's test environment and this checkout's plugins
- ``tiny_gguf``: a tiny Llama GGUF model for llama.cpp, written without a download
- ``k8s_api``: a FAKE Kubernetes API server (apps/v1, core/v1, k6-operator TestRuns) for the kubernetes tests
- ``k6_runners``: a k6-operator TestRun's runner pods and starter, as real k6 processes on this machine

The repository's root is on ``sys.path`` (pyproject.toml: pytest's ``pythonpath``), so ``tests`` is a
namespace package and this one of its packages; the test folders are not packages.
"""
