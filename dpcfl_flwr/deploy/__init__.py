"""Deployment on real silos: certificates, SuperLink / SuperNode launchers, compose topology."""
