"""The IO edge of vmsandbox: each module here reads or changes one outside system.

``sysfs`` (host inventory), ``ledger`` (the sqlite state database), ``hypervisor`` (libvirt),
``guest_channel`` (the virtio-serial socket to a guest), ``profile_loader`` (YAML profiles) and
``cdi_specs`` (CDI spec files). The modules directly under ``vmsandbox`` are pure: they import
none of these.
"""
