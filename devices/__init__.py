"""Device profiles, host calibration (`devices calibrate`) and the host-side simulator."""
