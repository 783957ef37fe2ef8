-- The results database, separate from Airflow's metadata (used by docker-compose.yaml).
CREATE USER deploybench WITH PASSWORD 'deploybench';
CREATE DATABASE deploybench OWNER deploybench;
