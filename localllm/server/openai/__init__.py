"""OpenAI's API: chat completions, completions, embeddings, models, and the Responses API."""
