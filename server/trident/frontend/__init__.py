"""OpenAI-compatible HTTP frontend over the Triton entry models (FastAPI; talks to Triton over gRPC)."""
