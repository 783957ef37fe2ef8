"""The simulated inference engine: a vLLM-compatible HTTP server whose capacity is known in closed form
(``service_model``), run on the lab's nodes and as plain local processes (``local``)."""
