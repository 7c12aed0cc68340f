"""The orchestrator: the public TTS API, pipeline, latency tracking, tts-cli and web demo."""
