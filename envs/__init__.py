"""rlfunc's own environments, registered with gymnasium on import."""
