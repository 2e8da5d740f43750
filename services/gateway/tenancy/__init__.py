"""Tenants: API keys and TENANTS_FILE, whom a request is accounted to, this gateway's early quota refusals, and the per-tenant view of /stats."""
