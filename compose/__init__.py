"""Running c4stream for real: docker compose, and the no-Docker local Kafka broker."""
