"""What a process needs from the machine it runs on: ports, devices, hosts."""
