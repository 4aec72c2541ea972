"""What a run leaves for people: ranking files, report.md, the heatmap, the MIB export."""
