"""Device profiles, delegate capabilities and the host-side simulator."""
