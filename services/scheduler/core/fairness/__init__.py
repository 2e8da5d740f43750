"""Who goes next: the FCFS and VTC policies, the virtual token counters, slot fairness and the tenants' quotas."""
