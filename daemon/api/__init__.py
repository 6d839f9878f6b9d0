"""The HTTP edge: the app and its guards, the OpenAI, Anthropic, Ollama and Responses APIs on one
generation path, llama-server's extras, ``/metrics`` and the page. It calls the daemon's API
(``strata.daemon.service``) and the control plane; nothing below it imports it."""
